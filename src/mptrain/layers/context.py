"""The layer-construction context: what every parallel layer of a model chunk is built with.

Megatron-core hands one ``TransformerConfig`` to every parallel layer (``megatron/core/transformer/
transformer_config.py``, ``model_parallel_config.py``); `LayerContext` is its parallel half: the
process groups, the effective sequence parallelism, the parameters' dtype, device and init, and
the TP-communication options. The model's own shape (sizes, dropout, norms) stays in
`mptrain.config.model.ModelConfig`, handed to the layers beside it as ``config``.

One context per model chunk, built by `GPTModel` (`layer_context`) and passed unchanged down the
layer spec tree (`mptrain.layers.spec.build_module`), so a user's layer in any node gets the same
record as the built-in ones::

    class MyLinear(torch.nn.Module):
        def __init__(self, input_size, output_size, *, context: LayerContext, name: str, bias: bool = True):
            ...
            w = context.init.normal(f"{name}.weight", (output_size, input_size))  # layout-independent
            self.weight = torch.nn.Parameter(w.to(device=context.device, dtype=context.params_dtype))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from mptrain.layers.random import ParamInit


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What a parallel layer is built with besides its sizes and the model config (frozen: shared by every layer).

    Attributes:
        groups: this rank's `mptrain.groups.ParallelGroups` (``tp_size``, ``tp_rank``, ``tp_group``, ...).
        init: the weights' initial values: ``init.normal(name, shape)`` draws the full, unpadded tensor
            from (``train.seed``, the global parameter name), so every layout starts from the same
            model; ``scaled=True`` is Megatron's ``output_layer_init_method`` (std / sqrt(2 L)).
        sequence_parallel: effective sequence parallelism (``parallel.sequence_parallel`` and tp > 1):
            activations between the TP regions are ``[s/tp, b, h]`` (Korthikanti et al. 2022, §4.2.2).
        params_dtype: dtype of the parameters a layer creates.
        device: where a layer creates them; None = ``init.device``.
        async_tensor_model_parallel_allreduce: ``parallel.async_tensor_model_parallel_allreduce``: a
            column-parallel linear overlaps its backward input-grad all-reduce (reduce-scatter under
            SP) with its weight-grad GEMM (`mptrain.layers.linear.column_parallel_linear`).
        gradient_accumulation_fusion: ``parallel.gradient_accumulation_fusion``: the DDP wrapper hands
            each linear layer its weight's ``main_grad`` view (``weight_main_grad``) and the weight-grad
            GEMM accumulates into it (`mptrain.layers.grad_accumulation`).
        tp_comm_overlap: ``parallel.tp_comm_overlap``: inside compiled layers, Inductor splits the
            SP all-gather / reduce-scatter and their GEMMs into per-rank steps
            (`mptrain.layers.mappings.enable_tp_comm_overlap`, turned on once per process by the trainer).
        cp_comm_type: ``parallel.cp_comm_type``: how the attention core reaches the keys and values of the
            other context-parallel ranks when ``groups.cp_size > 1`` (`mptrain.layers.cp_attention`).
    """

    groups: Any
    init: ParamInit
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    device: Optional[torch.device] = None
    async_tensor_model_parallel_allreduce: bool = True
    gradient_accumulation_fusion: bool = True
    tp_comm_overlap: bool = False
    cp_comm_type: str = "p2p"

    def __post_init__(self) -> None:
        if self.device is None:  # frozen: the one assignment, at construction
            object.__setattr__(self, "device", self.init.device)


def layer_context(parallel, groups, *, init: ParamInit, params_dtype: torch.dtype = torch.float32,
                  device: Optional[torch.device] = None) -> LayerContext:
    """The context of one model chunk from the ``parallel`` config node (`mptrain.config.parallel.ParallelConfig`).

    ``sequence_parallel`` is on only with tp > 1 (with one TP rank there is nothing to split).
    """
    return LayerContext(
        groups=groups, init=init, sequence_parallel=bool(parallel.sequence_parallel) and groups.tp_size > 1,
        params_dtype=params_dtype, device=device,
        async_tensor_model_parallel_allreduce=bool(parallel.async_tensor_model_parallel_allreduce),
        gradient_accumulation_fusion=bool(parallel.gradient_accumulation_fusion),
        tp_comm_overlap=bool(parallel.tp_comm_overlap),
        cp_comm_type=str(getattr(parallel, "cp_comm_type", "p2p")))
