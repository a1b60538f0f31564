"""Pre-LayerNorm transformer layer and the block of layers one model chunk holds.

Legend: ``[s, b, h]`` activations, ``[s/tp, b, h]`` under sequence parallelism (SP).

    x = x + dropout(attention(norm1(x)))          (GPT-2 pre-LN; Radford et al. 2019, §2.3)
    x = x + dropout(mlp(norm2(x)))

Hidden dropout draws from torch's current generator: the default stream (same on all TP ranks:
the activation is replicated) or, under SP, the model-parallel stream, because
`TransformerBlock` runs all its layers inside ``rng_tracker.fork()`` (megatron-core.md §3.9).

Recomputation (DESIGN.md §1 keys, Megatron ``transformer_block.py::_checkpointed_forward``):
``recompute_granularity=full`` with ``recompute_method=uniform`` checkpoints consecutive groups of
``recompute_num_layers`` layers; ``block`` checkpoints the first ``recompute_num_layers`` layers
of each chunk one by one; ``selective`` recomputes only the attention core (`SelfAttention`).

Spec tree: ``model.transformer_layer`` (kind `TRANSFORMER_LAYER`) with ``submodules``
input_layernorm, self_attention, pre_mlp_layernorm, mlp (`mptrain.layers.spec`). The block's
``final_layernorm`` is built from the ``input_layernorm`` node (one norm choice per model).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mptrain.components import ComponentKind
from mptrain.errors import ConfigError, check_choice
from mptrain.layers.attention import SELF_ATTENTION
from mptrain.layers.mlp import MLP_KIND
from mptrain.layers.norms import NORM
from mptrain.layers.random import ParamInit, checkpoint
from mptrain.layers.spec import LAYER_KEY, build_module, submodule

RECOMPUTE_GRANULARITIES = (None, "full", "selective")
"""``model.recompute_granularity`` (null | full | selective)."""
RECOMPUTE_METHODS = (None, "uniform", "block")
"""``model.recompute_method`` (null | uniform | block; with granularity full)."""


def check_recompute(model) -> None:
    """The recompute keys (Megatron's): closed choices and their combination.

    Raises:
        ConfigError: unknown granularity / method; full without a method; a method without full;
            full with recompute_num_layers < 1.
    """
    check_choice("model.recompute_granularity", model.recompute_granularity, RECOMPUTE_GRANULARITIES)
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


COMPILE_MODES = ("auto", None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``model.compile_mode``: ``auto``, null (Inductor's default) and torch.compile's modes."""


def compile_mode_for(config, groups, device: Optional[torch.device], chunk: bool) -> Optional[str]:
    """The ``torch.compile`` mode of a model chunk's graph (``chunk``) or of a layer's graph:
    ``model.compile_mode``, with ``auto`` resolved to ``reduce-overhead`` (CUDA graphs) for a chunk
    graph on CUDA at tp = pp = 1, else None (Inductor's default). Why only there: with pp > 1 several micro-batches' outputs are alive at once (1F1B), and
    at tp > 1 the graph holds NCCL collectives; CUDA graphs pay off where the host is the bottleneck,
    which is the small single-GPU model."""
    if config.compile_mode != "auto":
        return config.compile_mode
    single = groups.tp_size == 1 and groups.pp_size == 1
    return "reduce-overhead" if chunk and device.type == "cuda" and single else None


def _layer_submodules(submodules):
    if submodules is None:
        from mptrain.config.model import TransformerLayerSubmodules

        submodules = TransformerLayerSubmodules()
    return {"submodules": submodules}


def build_norm_node(submodules, name: str, config, *, sequence_parallel: bool, params_dtype: torch.dtype,
                    device: Optional[torch.device]) -> torch.nn.Module:
    """The norm node ``submodules.<name>`` over h with ``model.layernorm_epsilon`` (kind NORM)."""
    return build_module(f"{LAYER_KEY}.submodules.{name}", submodule(_layer_submodules(submodules), name), NORM,
                        hidden_size=config.hidden_size, config=config, eps=config.layernorm_epsilon,
                        sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)


class TransformerLayer(torch.nn.Module):
    """One pre-LN layer; the registered component ``model.transformer_layer`` (kind `TRANSFORMER_LAYER`).

    Args:
        config: ModelConfig. groups: ParallelGroups. parallel: ParallelConfig.
        layer_number: global 0-based index (names its params ``decoder.layers.<n>.*`` and seeds their init).
        init: ParamInit. rng_tracker: RNGStatesTracker.
        submodules: the node's ``submodules`` (input_layernorm, self_attention, pre_mlp_layernorm, mlp);
            None = the default `mptrain.config.model.TransformerLayerSubmodules`.
    forward(x ``[s(/tp), b, h]``, attention_mask) -> same shape.
    """

    def __init__(self, config, groups, *, parallel, layer_number: int, init: ParamInit, rng_tracker,
                 submodules=None, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        sp = bool(parallel.sequence_parallel) and groups.tp_size > 1
        self.layer_number, self.hidden_dropout = layer_number, config.hidden_dropout
        node = _layer_submodules(submodules)
        kw = dict(params_dtype=params_dtype, device=device)
        linear_kw = dict(async_grad_allreduce=bool(parallel.async_tensor_model_parallel_allreduce),
                         wgrad_transpose=bool(parallel.tf32_wgrad_transpose), **kw)
        inner = dict(config=config, groups=groups, layer_number=layer_number, init=init, sequence_parallel=sp,
                     **linear_kw)
        self.input_layernorm = build_norm_node(submodules, "input_layernorm", config, sequence_parallel=sp, **kw)
        self.self_attention = build_module(f"{LAYER_KEY}.submodules.self_attention", submodule(node, "self_attention"),
                                           SELF_ATTENTION, rng_tracker=rng_tracker, **inner)
        self.pre_mlp_layernorm = build_norm_node(submodules, "pre_mlp_layernorm", config, sequence_parallel=sp, **kw)
        self.mlp = build_module(f"{LAYER_KEY}.submodules.mlp", submodule(node, "mlp"), MLP_KIND, **inner)
        # model.compile_layers: one torch.compile wrapper per layer; Dynamo caches by code object, so
        # every layer reuses the graphs traced for the first one (parameters are graph inputs).
        self._compiled_body = (torch.compile(self._body, mode=compile_mode_for(config, groups, device, chunk=False))
                               if config.compile_layers else None)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.hidden_dropout, training=True) if self.training and self.hidden_dropout > 0 else x

    def _body(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), attention_mask))
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._compiled_body is not None:
            return self._compiled_body(x, attention_mask)
        return self._body(x, attention_mask)


TRANSFORMER_LAYER = ComponentKind(
    "transformer layer", methods=("forward",),
    runtime_keywords=("config", "groups", "parallel", "layer_number", "init", "rng_tracker", "submodules",
                      "params_dtype", "device"),
    interface=TransformerLayer)
"""``forward(x [s(/tp), b, h], attention_mask [b, 1, s, s] bool | None) -> [s(/tp), b, h]``; parameters
named relative to ``decoder.layers.<n>`` (checkpoints address them by name)."""


class TransformerBlock(torch.nn.Module):
    """The layers of one model chunk (+ the final norm on the last stage).

    ``layers`` is a ModuleDict keyed by the *global* layer index, so parameter names
    (``decoder.layers.5.mlp.linear_fc1.weight``) are the same in every layout.

    Args:
        layer_factory: builds one layer from the runtime keywords (config, groups, parallel, layer_number,
            init, rng_tracker, params_dtype, device); default: the ``model.transformer_layer`` spec node.
        layer_numbers: global indices of this chunk's layers. final_norm: add ``final_layernorm`` (built
            from the layer spec's ``input_layernorm`` node).
        rng_fork: under sequence parallelism run the layers in the TP RNG fork (default); False inside a
            compiled chunk, where nothing draws (`mptrain.layers.gpt.chunk_compile_blocker`).
    """

    def __init__(self, config, groups, *, parallel, layer_numbers: list, init: ParamInit, rng_tracker,
                 final_norm: bool, layer_factory: Optional[Callable] = None, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, rng_fork: bool = True) -> None:
        super().__init__()
        self.sequence_parallel = bool(parallel.sequence_parallel) and groups.tp_size > 1
        self.rng_fork = rng_fork and self.sequence_parallel
        self.rng_tracker = rng_tracker
        self.recompute = config.recompute_granularity == "full"
        self.recompute_method = config.recompute_method or "uniform"
        self.recompute_num_layers = config.recompute_num_layers or 1
        spec = config.transformer_layer
        if layer_factory is None:
            layer_factory = functools.partial(build_module, LAYER_KEY, spec, TRANSFORMER_LAYER)
        self.layers = torch.nn.ModuleDict({
            str(n): layer_factory(config=config, groups=groups, parallel=parallel, layer_number=n, init=init,
                                  rng_tracker=rng_tracker, params_dtype=params_dtype, device=device)
            for n in layer_numbers
        })
        self.final_layernorm = (build_norm_node(getattr(spec, "submodules", None) if not isinstance(spec, dict)
                                                else spec.get("submodules"), "input_layernorm", config,
                                                sequence_parallel=self.sequence_parallel, params_dtype=params_dtype,
                                                device=device) if final_norm else None)

    def _run(self, layers: list, x: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        for layer in layers:
            x = layer(x, attention_mask)
        return x

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> ``[s(/tp), b, h]`` (normalised by the final norm on the last stage)."""
        layers = list(self.layers.values())
        with self.rng_tracker.fork() if self.rng_fork else contextlib.nullcontext():
            if self.recompute and self.training and torch.is_grad_enabled():
                if not x.requires_grad:  # checkpoint's output needs a grad-requiring input to carry param grads
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
