"""Building the layer spec tree (Megatron-core's ``ModuleSpec`` / ``build_module``, written as config).

The tree lives under ``model.transformer_layer`` (schema: `mptrain.config.model.TransformerLayerSpec`)::

    transformer_layer          TransformerLayer            kind TRANSFORMER_LAYER (transformer.py)
      input_layernorm          norms.Norm                  kind NORM              (norms.py)
      self_attention           attention.SelfAttention     kind SELF_ATTENTION    (attention.py)
        linear_qkv             linear.ColumnParallelLinear kind COLUMN_PARALLEL_LINEAR (here)
        core_attention         attention.DotProductAttention kind CORE_ATTENTION  (attention.py)
        linear_proj            linear.RowParallelLinear    kind ROW_PARALLEL_LINEAR (here)
        q_layernorm, k_layernorm  norms.Norm (model.qk_layernorm)  kind NORM
      pre_mlp_layernorm        norms.Norm                  kind NORM
      mlp                      mlp.MLP                     kind MLP               (mlp.py)
        linear_fc1             linear.ColumnParallelLinear kind COLUMN_PARALLEL_LINEAR
        activation             mlp.Activation              kind ACTIVATION        (mlp.py)
        linear_fc2             linear.RowParallelLinear    kind ROW_PARALLEL_LINEAR

`build_module` is the one way a parent builds a child: `mptrain.components.build` (import,
interface methods, the node's own keys checked against the target's signature) returns a partial,
which is called with the runtime keywords the target accepts. Passing only the accepted ones lets
a plain class such as ``torch.nn.GELU`` sit in the tree unchanged. Runtime keywords win over the
node's keys of the same name (sizes and the context are not the config's to choose). Every
parallel node gets the chunk's one `mptrain.layers.context.LayerContext` as ``context`` (groups,
sequence_parallel, params_dtype, device, init, the TP-communication options).

Import order: this module knows no layer; the layers import it to build their children, and the
tree of kinds (`mptrain.layers.transformer.spec_kinds`) lives with the tree's root. `check_spec_node`
runs the import/interface/keyword checks on every node at start-up
(`mptrain.layers.transformer.check_spec_tree`), before any process group exists.
"""

from __future__ import annotations

from typing import Any

from mptrain.components import ComponentKind, accepted_keywords, build, node_items, rejected_arguments, resolve
from mptrain.errors import ConfigError
from mptrain.layers.linear import ColumnParallelLinear, RowParallelLinear

LAYER_KEY = "model.transformer_layer"
SUBMODULES = "submodules"

COLUMN_PARALLEL_LINEAR = ComponentKind(
    "column-parallel linear", methods=("forward",),
    runtime_keywords=("input_size", "output_size", "context", "name", "bias", "parts"),
    interface=ColumnParallelLinear)
"""linear_qkv / linear_fc1: ``target(input_size, output_size, *, context, name, bias, parts)``,
``forward(x [s(/tp), b, in]) -> (y [s, b, out/tp], bias or None)``; see
`ColumnParallelLinear` (weight ``[out/tp, in]``, `local_shard_specs`, ``weight_main_grad``)."""

ROW_PARALLEL_LINEAR = ComponentKind(
    "row-parallel linear", methods=("forward",),
    runtime_keywords=("input_size", "output_size", "context", "name", "bias", "input_is_parallel", "scaled_init"),
    interface=RowParallelLinear)
"""linear_proj / linear_fc2: ``target(input_size, output_size, *, context, name, bias, input_is_parallel,
scaled_init)``, ``forward(x [s, b, in/tp]) -> (y [s(/tp), b, out], bias or None)``; see
`RowParallelLinear` (weight ``[out, in/tp]``, reduce over TP, or reduce-scatter under SP)."""


def with_returned_bias(out: tuple) -> Any:
    """A linear node's output ``(y, bias or None)`` as one tensor, ``y + bias``: a linear that returns its bias
    instead of adding it (Megatron's ``skip_bias_add``) leaves the add to its parent, which does it here."""
    y, bias = out
    return y if bias is None else y + bias


def submodule(node: Any, name: str) -> Any:
    """The child node ``node.submodules.<name>`` (schema dataclass or mapping)."""
    subs = node_items(node).get(SUBMODULES)
    child = subs.get(name) if isinstance(subs, dict) else getattr(subs, name, None)
    if child is None:
        raise ConfigError(f"{name}: the layer spec node has no submodules.{name}; add it (docs/COMPONENTS.md)")
    return child


def build_module(key: str, node: Any, kind: ComponentKind, **runtime: Any) -> Any:
    """Build one spec node: ``target(**node keys, **runtime keywords it accepts[, submodules=...])``.

    Args:
        key: the node's config key, for messages (``model.transformer_layer.submodules.mlp``).
        node: the spec node (``_target_``, ``_partial_``, optional ``submodules``, the target's own keys).
        kind: the node's ComponentKind.
        runtime: what the parent supplies (config, context, sizes, name, ...); a node with
            ``submodules`` also gets them as ``submodules=``.
    Returns:
        the built module (or whatever the target returns).
    Raises:
        ConfigError: bad target (see `mptrain.components`), or the target rejecting its arguments.
    """
    factory = build(key, node, kind, drop=(SUBMODULES,), partial=True)
    subs = node_items(node).get(SUBMODULES)
    if subs is not None:
        runtime[SUBMODULES] = getattr(node, SUBMODULES, None) if not isinstance(node, dict) else subs
    accepted = accepted_keywords(factory.func)
    kwargs = runtime if accepted is None else {k: v for k, v in runtime.items() if k in accepted}
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        if isinstance(err, TypeError) and err.__traceback__ is not None and err.__traceback__.tb_next is None:
            # the call's own signature mismatch (a required argument we do not pass)
            raise ConfigError(f"{key}: {node_items(node).get('_target_')} cannot be built with the runtime keywords "
                              f"({err}); it may take: {', '.join(sorted(kind.runtime_keywords))}") from None
        # raised inside the target's constructor (e.g. a wrong-typed `+...window=abc`): alike on every rank
        raise rejected_arguments(key, node_items(node), err) from None


def check_spec_node(key: str, node: Any, kinds: dict) -> None:
    """`components.resolve` on `node` and, recursively, on its submodules (kinds: child name -> kind or dict).

    `kinds` mirrors the tree: ``{"_kind": ComponentKind, "<child>": {...}}``.
    """
    resolve(key, node, kinds["_kind"], drop=(SUBMODULES,))
    for name, child_kinds in kinds.items():
        if name != "_kind":
            check_spec_node(f"{key}.{SUBMODULES}.{name}", submodule(node, name), child_kinds)
