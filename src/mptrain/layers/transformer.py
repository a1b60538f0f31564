"""Pre-LayerNorm transformer layer and the block of layers one model chunk holds.

Legend: ``[s, b, h]`` activations, ``[s/tp, b, h]`` under sequence parallelism (SP).

    x = x + dropout(attention(norm1(x)))          (GPT-2 pre-LN; Radford et al. 2019, §2.3)
    x = x + dropout(mlp(norm2(x)))

Hidden dropout draws from torch's current generator: the default stream (same on all TP ranks:
the activation is replicated) or, under SP, the model-parallel stream, because
`TransformerBlock` runs all its layers inside ``rng_tracker.fork()``
(megatron/core/transformer/transformer_block.py). In a compiled chunk there is no fork: under SP each
rank takes its rows of a mask drawn over the whole sequence (`mptrain.layers.random.dropout_slice`).

Recomputation (DESIGN.md §1 keys, Megatron ``transformer_block.py::_checkpointed_forward``):
``recompute_granularity=full`` with ``recompute_method=uniform`` checkpoints consecutive groups of
``recompute_num_layers`` layers; ``block`` checkpoints the first ``recompute_num_layers`` layers
of each chunk one by one; ``selective`` recomputes only the attention core (`SelfAttention`).

Spec tree: ``model.transformer_layer`` (kind `TRANSFORMER_LAYER`) with ``submodules``
input_layernorm, self_attention, pre_mlp_layernorm, mlp (or, on the layers ``model.moe_layer_freq`` marks
when ``model.num_moe_experts`` is set, moe: `mptrain.layers.moe.MoELayer`, as the ``mlp`` attribute), each built by
`mptrain.layers.spec.build_module` with the chunk's `LayerContext`. The block's ``final_layernorm``
is built from the ``input_layernorm`` node (one norm choice per model). The tree's kinds
(`spec_kinds`) and its start-up check (`check_spec_tree`) live here, with the tree's root.

Compilation (``model.compile_layers``) is applied from outside (`mptrain.layers.compile.apply_compile`):
under ``compile_scope=layer`` each layer's ``compile`` compiles its body in place.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mptrain.components import ComponentKind, node_items
from mptrain.config.model import TransformerLayerSubmodules, recompute_granularity
from mptrain.errors import ConfigError, check_choice
from mptrain.layers.attention import CORE_ATTENTION, SELF_ATTENTION
from mptrain.layers.context import LayerContext
from mptrain.layers.kv_cache import LayerKVCache
from mptrain.layers.mlp import ACTIVATION, MLP_KIND
from mptrain.layers.moe.config import is_moe, is_moe_layer
from mptrain.layers.moe.layer import MOE_KIND, moe_spec_kinds
from mptrain.layers.norms import NORM
from mptrain.layers.random import checkpoint, dropout_slice, in_compiled_region
from mptrain.layers.spec import (
    COLUMN_PARALLEL_LINEAR,
    LAYER_KEY,
    ROW_PARALLEL_LINEAR,
    SUBMODULES,
    build_module,
    check_spec_node,
    submodule,
)

RECOMPUTE_GRANULARITIES = (None, "full", "selective")
"""``model.recompute_granularity`` (null | full | selective)."""
RECOMPUTE_METHODS = (None, "uniform", "block")
"""``model.recompute_method`` (null | uniform | block; with granularity full)."""


def check_recompute(model) -> None:
    """The recompute keys (Megatron's): closed choices and their combination.

    Raises:
        ConfigError: unknown granularity / method; full without a method; a method without full;
            full with recompute_num_layers < 1; recompute_activations with granularity full.
    """
    check_choice("model.recompute_granularity", model.recompute_granularity, RECOMPUTE_GRANULARITIES)
    if model.recompute_activations and model.recompute_granularity not in (None, "selective"):
        raise ConfigError(
            f"model.recompute_activations=true means recompute_granularity=selective, but "
            f"model.recompute_granularity={model.recompute_granularity}; set model.recompute_activations=false or "
            "model.recompute_granularity=null")
    check_choice("model.recompute_method", model.recompute_method, RECOMPUTE_METHODS)
    if model.recompute_granularity == "full" and model.recompute_method is None:
        raise ConfigError(
            "model.recompute_granularity=full needs model.recompute_method=uniform or block (and recompute_num_layers)")
    if model.recompute_granularity != "full" and model.recompute_method is not None:
        raise ConfigError(
            f"model.recompute_method={model.recompute_method} needs model.recompute_granularity=full "
            f"(got {model.recompute_granularity}); set model.recompute_method=null")
    n = model.recompute_num_layers
    if model.recompute_granularity == "full" and (n is None or n < 1):
        raise ConfigError(f"model.recompute_num_layers={n} must be an integer >= 1")


def _layer_submodules(submodules):
    if submodules is None:
        submodules = TransformerLayerSubmodules()
    return {"submodules": submodules}


def build_norm_node(submodules, name: str, config, *, context: LayerContext) -> torch.nn.Module:
    """The norm node ``submodules.<name>`` over h with ``model.layernorm_epsilon`` (kind NORM)."""
    return build_module(f"{LAYER_KEY}.submodules.{name}", submodule(_layer_submodules(submodules), name), NORM,
                        hidden_size=config.hidden_size, config=config, eps=config.layernorm_epsilon, context=context)


class TransformerLayer(torch.nn.Module):
    """One pre-LN layer; the registered component ``model.transformer_layer`` (kind `TRANSFORMER_LAYER`).

    Args:
        config: ModelConfig. context: `LayerContext` (groups, sequence_parallel, init, params_dtype,
            device, TP-communication options), handed to every child node.
        layer_number: global 0-based index (names its params ``decoder.layers.<n>.*`` and seeds their init).
        rng_tracker: RNGStatesTracker.
        submodules: the node's ``submodules`` (input_layernorm, self_attention, pre_mlp_layernorm, mlp);
            None = the default `mptrain.config.model.TransformerLayerSubmodules`.
    forward(x ``[s(/tp), b, h]``, attention_mask) -> same shape.
    """

    def __init__(self, config, context: LayerContext, *, layer_number: int, rng_tracker, submodules=None) -> None:
        super().__init__()
        self.layer_number, self.hidden_dropout = layer_number, config.hidden_dropout
        # where this rank's [s/tp, b, h] rows sit in the sequence (sequence parallelism), for compiled dropout
        sp = context.sequence_parallel
        self._sp_index, self._sp_parts = (context.groups.tp_rank, context.groups.tp_size) if sp else (0, 1)
        node = _layer_submodules(submodules)
        inner = dict(config=config, context=context, layer_number=layer_number)
        self.input_layernorm = build_norm_node(submodules, "input_layernorm", config, context=context)
        self.self_attention = build_module(f"{LAYER_KEY}.submodules.self_attention", submodule(node, "self_attention"),
                                           SELF_ATTENTION, rng_tracker=rng_tracker, **inner)
        self.pre_mlp_layernorm = build_norm_node(submodules, "pre_mlp_layernorm", config, context=context)
        if is_moe_layer(config, layer_number):  # the MoE layer takes the MLP's place (and its parameter names)
            self.mlp = build_module(f"{LAYER_KEY}.submodules.moe", submodule(node, "moe"), MOE_KIND, **inner)
        else:
            self.mlp = build_module(f"{LAYER_KEY}.submodules.mlp", submodule(node, "mlp"), MLP_KIND, **inner)
        self._compiled_body: Optional[Callable] = None  # set by `compile`

    def compile(self, *args, **kwargs) -> None:
        """Compile this layer's body in place (``torch.compile(self._body, *args, **kwargs)``; called by
        `mptrain.layers.compile.apply_compile` under ``compile_scope=layer``). Unlike
        ``torch.nn.Module.compile`` the forward hooks stay eager; parameter names are unchanged."""
        self._compiled_body = torch.compile(self._body, *args, **kwargs)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.hidden_dropout > 0):
            return x
        if in_compiled_region():  # no fork in a graph: under SP, this rank's rows of a whole-sequence mask
            return dropout_slice(x, self.hidden_dropout, dim=0, index=self._sp_index, parts=self._sp_parts)
        return F.dropout(x, self.hidden_dropout, training=True)

    def _body(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
              kv_cache: Optional[LayerKVCache] = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        # the cache keyword only when decoding: a plugged-in attention without one still trains
        attn = (self.self_attention(h, attention_mask) if kv_cache is None
                else self.self_attention(h, attention_mask, kv_cache=kv_cache))
        x = x + self._dropout(attn)
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[LayerKVCache] = None) -> torch.Tensor:
        """x ``[s(/tp), b, h]`` -> same shape. ``kv_cache``: this layer's cache for incremental decoding,
        handed to ``self_attention`` (`SelfAttention.forward`); eager even with ``compile_layers``."""
        if kv_cache is not None:  # decoding runs eagerly: the cache length changes every call
            return self._body(x, attention_mask, kv_cache)
        if self._compiled_body is not None:
            return self._compiled_body(x, attention_mask)
        return self._body(x, attention_mask)


TRANSFORMER_LAYER = ComponentKind(
    "transformer layer", methods=("forward",),
    runtime_keywords=("config", "context", "layer_number", "rng_tracker", "submodules"),
    interface=TransformerLayer)
"""``forward(x [s(/tp), b, h], attention_mask [b, 1, s, s] bool | DocumentMask | None) -> [s(/tp), b, h]``; parameters
named relative to ``decoder.layers.<n>`` (checkpoints address them by name)."""


class TransformerBlock(torch.nn.Module):
    """The layers of one model chunk (+ the final norm on the last stage).

    ``layers`` is a ModuleDict keyed by the *global* layer index, so parameter names
    (``decoder.layers.5.mlp.linear_fc1.weight``) are the same in every layout.

    Args:
        config: ModelConfig. context: `LayerContext` (every layer gets it).
        layer_factory: builds one layer from the runtime keywords (config, context, layer_number,
            rng_tracker); default: the ``model.transformer_layer`` spec node.
        layer_numbers: global indices of this chunk's layers. final_norm: add ``final_layernorm`` (built
            from the layer spec's ``input_layernorm`` node).
        rng_fork: under sequence parallelism run the layers in the TP RNG fork (default); False inside a
            compiled chunk, whose dropout needs no fork (`mptrain.layers.random.dropout_slice`).
    """

    def __init__(self, config, context: LayerContext, *, layer_numbers: list, rng_tracker, final_norm: bool,
                 layer_factory: Optional[Callable] = None, rng_fork: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = context.sequence_parallel
        self.rng_fork = rng_fork and self.sequence_parallel
        self.rng_tracker = rng_tracker
        self.recompute = recompute_granularity(config) == "full"
        self.recompute_method = config.recompute_method or "uniform"
        self.recompute_num_layers = config.recompute_num_layers or 1
        spec = config.transformer_layer
        if layer_factory is None:
            layer_factory = functools.partial(build_module, LAYER_KEY, spec, TRANSFORMER_LAYER)
        self.layers = torch.nn.ModuleDict({
            str(n): layer_factory(config=config, context=context, layer_number=n, rng_tracker=rng_tracker)
            for n in layer_numbers
        })
        self.final_layernorm = (build_norm_node(getattr(spec, "submodules", None) if not isinstance(spec, dict)
                                                else spec.get("submodules"), "input_layernorm", config,
                                                context=context) if final_norm else None)

    def _run(self, layers: list, x: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        for layer in layers:
            x = layer(x, attention_mask)
        return x

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> ``[s(/tp), b, h]`` (normalised by the final norm on the last stage)."""
        layers = list(self.layers.values())
        with self.rng_tracker.fork() if self.rng_fork else contextlib.nullcontext():
            if self.recompute and self.training and torch.is_grad_enabled():
                if not x.requires_grad and not in_compiled_region():
                    # the eager checkpoint's output needs a grad-requiring input to carry param grads
                    x = x.detach().requires_grad_(True)
                n = self.recompute_num_layers
                if self.recompute_method == "uniform":
                    for i in range(0, len(layers), n):
                        x = checkpoint(lambda t, m, ls=layers[i:i + n]: self._run(ls, t, m), self.rng_tracker,
                                       x, attention_mask)
                else:  # block: the first n layers of this chunk, one checkpoint each
                    for i, layer in enumerate(layers):
                        x = checkpoint(layer, self.rng_tracker, x, attention_mask) if i < n else layer(x, attention_mask)
            else:
                x = self._run(layers, x, attention_mask)
            if self.final_layernorm is not None:
                x = self.final_layernorm(x)
        return x


def spec_kinds() -> dict:
    """The kind of every node of the default tree (nested like the config: ``{"_kind": kind, "<child>": {...}}``)."""
    return {
        "_kind": TRANSFORMER_LAYER,
        "input_layernorm": {"_kind": NORM},
        "self_attention": {"_kind": SELF_ATTENTION, "linear_qkv": {"_kind": COLUMN_PARALLEL_LINEAR},
                           "core_attention": {"_kind": CORE_ATTENTION}, "linear_proj": {"_kind": ROW_PARALLEL_LINEAR},
                           "q_layernorm": {"_kind": NORM}, "k_layernorm": {"_kind": NORM}},
        "pre_mlp_layernorm": {"_kind": NORM},
        "mlp": {"_kind": MLP_KIND, "linear_fc1": {"_kind": COLUMN_PARALLEL_LINEAR}, "activation": {"_kind": ACTIVATION},
                "linear_fc2": {"_kind": ROW_PARALLEL_LINEAR}},
        "moe": moe_spec_kinds(),
    }


def check_spec_tree(model) -> None:
    """Start-up check of ``model.transformer_layer`` and every node under it (pure: imports and signatures).

    A user's layer target without submodules is checked alone (its tree is its own business); the ``moe``
    node only for an MoE model.
    Raises:
        ConfigError: the first bad node (no import, missing method, unknown keyword), naming its key.
    """
    node = model.transformer_layer
    kinds = spec_kinds()
    if not is_moe(model):  # a dense model never builds the moe node (a user's tree need not have one)
        kinds.pop("moe")
    if node_items(node).get(SUBMODULES) is None:
        kinds = {"_kind": kinds["_kind"]}
    check_spec_node(LAYER_KEY, node, kinds)
