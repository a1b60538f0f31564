"""Tensor-parallel linear layers (Megatron ``tensor_parallel/layers.py``; Shoeybi et al. 2019, §3).

Legend: activations ``[s, b, h]`` (``[s/tp, b, h]`` in sequence-parallel regions); weights are
stored as torch does, ``[out, in]``; ``tp`` = tensor-parallel size, ``r`` = tp rank.

Both layers return ``(output, bias)``: ``bias`` is None unless ``skip_bias_add`` (then the caller
adds it, e.g. to fuse it with dropout).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mptrain.errors import ConfigError
from mptrain.layers import grad_accumulation
from mptrain.layers.context import LayerContext
from mptrain.layers.fp8 import IN_FP8, Fp8Gemms, Fp8Recipe, Fp8WeightCast, fp8_gemm_decision, fp8_gemms
from mptrain.layers.grad_accumulation_fusion import MainGradOf
from mptrain.layers.mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_sequence_parallel_region_raw,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    start_grad_collective,
)
from mptrain.layers.sharding import ShardSpec, take_shard


def column_parallel_input(x: torch.Tensor, groups, sequence_parallel: bool) -> torch.Tensor:
    """Enter a TP region: f (copy) or, under SP, all-gather ``[s/tp, b, h] -> [s, b, h]`` (bwd reduce-scatter)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, groups.tp_group)
    return copy_to_tp_region(x, groups.tp_group)


class _LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``Y = X Wᵀ + b`` whose input-grad collective overlaps the weight-grad GEMM, and whose weight
    grad may go straight into ``main_grad``. Megatron's class of the same name.

    With a ``group`` (column-parallel, ``async_tensor_model_parallel_allreduce``): backward
    computes dgrad = dY W, launches its all-reduce over TP (or, under sequence
    parallelism, its reduce-scatter to ``[s/tp, b, in]``) asynchronously, computes wgrad = dYᵀ X and
    the bias grad while the collective runs (in FP8 the bias grad comes first, beside dY's cast), then
    waits. Same math as f / ḡ followed by ``F.linear``. Forward under SP all-gathers ``[s/tp, b, in] -> [s, b, in]`` first and saves the
    gathered input (as ``F.linear``'s autograd would).

    In eager mode the collective is ``dist.*(async_op=True)``; under ``torch.compile`` (layers
    compiled by ``model.compile_layers``) the functional collective + ``wait_tensor`` (Dynamo
    cannot trace ``async_op=True``), which Inductor schedules.

    ``group`` None: no collective (a row-parallel layer, or a column-parallel one whose collective
    runs outside).

    With ``main_grad`` (``parallel.gradient_accumulation_fusion``) the weight-grad GEMM accumulates
    into it and no weight grad is returned (`grad_accumulation.wgrad_accumulate`). Where
    `grad_accumulation.tf32_kmajor_pays` (fp32 on CUDA with TF32 on), the weight-grad GEMM gets a
    K-major operand copy (`grad_accumulation.weight_grad`).

    With ``fp8`` (an `mptrain.layers.fp8.Fp8Gemms`, ``precision=fp8``) the three GEMMs run in FP8
    (`Fp8Gemms.forward` / ``backward``: casts with TP-reduced amaxes); the communications, the bias and
    the accumulation into ``main_grad`` are the same. ``fp8_weight`` (an `mptrain.layers.fp8.Fp8WeightCast`):
    the weight's FP8 cast made once per optimizer step, used instead of casting it here.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, main_grad=None, fp8=None, fp8_weight=None):
        total = gather_from_sequence_parallel_region_raw(x, group) if sequence_parallel else x
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.main_grad = main_grad  # not saved: a buffer view that other views mutate (version check)
        ctx.fp8, ctx.input_shape = fp8, total.shape
        if fp8 is None:
            ctx.save_for_backward(total, weight)
            return F.linear(total, weight, bias)  # [s, b, out/tp]
        y, saved = fp8.forward(total.reshape(-1, total.shape[-1]), weight, fp8_weight)  # [s·b, out/tp]
        ctx.save_for_backward(*saved)
        # not a view of the GEMM's output: a custom Function's output may be modified in place (g's all-reduce)
        y = torch.ops.aten._unsafe_view(y, (*total.shape[:-1], y.shape[-1]))  # [s, b, out/tp]
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        if ctx.fp8 is not None:
            return _fp8_backward(ctx, grad_out)
        total, weight = ctx.saved_tensors
        pending = None
        if ctx.needs_input_grad[0]:
            grad_in = grad_out.matmul(weight)  # [s, b, in], a partial sum over TP ranks (with a group)
            if ctx.group is not None:
                pending = start_grad_collective(grad_in, ctx.group, ctx.sequence_parallel)
        go2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = None
        if ctx.needs_input_grad[1]:
            kmajor = grad_accumulation.tf32_kmajor_pays(go2)
            grad_w = grad_accumulation.weight_grad(go2, total.reshape(-1, total.shape[-1]), ctx.main_grad, kmajor,
                                                   gathered_input=ctx.sequence_parallel)
        grad_b = go2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if pending is not None:
            grad_in = pending.wait()
        elif not ctx.needs_input_grad[0]:
            grad_in = None
        return grad_in, grad_w, grad_b, None, None, None, None, None


def _fp8_backward(ctx, grad_out: torch.Tensor) -> tuple:
    """`_LinearWithGradAccumulationAndAsyncCommunication.backward` with FP8 GEMMs: the dgrad GEMM, its
    collective launched before the wgrad GEMM (into ``main_grad`` when fused), then the wait."""
    go2 = grad_out.reshape(-1, grad_out.shape[-1])  # [s·b, out/tp]
    saved = ctx.saved_tensors
    bias_grad = ctx.has_bias and ctx.needs_input_grad[2]
    dy8 = ctx.fp8.cast_grad_output(go2, with_bias_grad=bias_grad)
    grad_b = go2.sum(dim=0) if bias_grad else None  # beside the cast's amax: one pass over dy (cast_grad_output)
    grad_in = pending = None
    if ctx.needs_input_grad[0]:
        grad_in = ctx.fp8.grad_input(dy8, saved).reshape(ctx.input_shape)  # [s, b, in], partial over TP (with a group)
        if ctx.group is not None:
            pending = start_grad_collective(grad_in, ctx.group, ctx.sequence_parallel)
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = ctx.fp8.grad_weight(go2, dy8, saved)  # [out/tp, in]
        if ctx.main_grad is not None:
            grad_accumulation.accumulate_into(ctx.main_grad, grad_w)
            grad_w = None
    if pending is not None:
        grad_in = pending.wait()
    return grad_in, grad_w, grad_b, None, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           main_grad: Optional[torch.Tensor], fp8: Optional[Fp8Gemms] = None,
           fp8_weight: Optional[Fp8WeightCast] = None) -> torch.Tensor:
    """``F.linear``, with our weight-grad GEMM (into ``main_grad`` when one is given; K-major
    operands where `grad_accumulation.tf32_kmajor_pays`) when grads are on; torch's autograd otherwise.
    With ``fp8`` (`mptrain.layers.fp8.Fp8Gemms`) always ours: its GEMMs in FP8, with grads on or off
    (``fp8_weight``: the weight's cached cast, `mptrain.layers.fp8.Fp8WeightCast`)."""
    ours = fp8 is not None or torch.is_grad_enabled() and weight.requires_grad and (
        main_grad is not None or grad_accumulation.tf32_kmajor_pays(weight))
    if ours:
        return _LinearWithGradAccumulationAndAsyncCommunication.apply(x, weight, bias, None, False, main_grad, fp8,
                                                                      fp8_weight)
    return F.linear(x, weight, bias)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups,
                           sequence_parallel: bool, async_grad_allreduce: bool = True,
                           main_grad: Optional[torch.Tensor] = None, fp8: Optional[Fp8Gemms] = None,
                           fp8_weight: Optional[Fp8WeightCast] = None) -> torch.Tensor:
    """f (or SP's all-gather) then ``F.linear``: ``[s(/tp), b, in] -> [s, b, out/tp]``.

    ``async_grad_allreduce`` (``parallel.async_tensor_model_parallel_allreduce``) overlaps the
    backward input-grad collective with the weight-grad GEMM
    (`_LinearWithGradAccumulationAndAsyncCommunication`); off, the
    collective runs after both GEMMs (autograd of `column_parallel_input` + ``F.linear``).
    ``main_grad``: accumulate the weight grad into it (gradient accumulation fusion).
    ``fp8``: compute the GEMMs in FP8 (`mptrain.layers.fp8.Fp8Gemms`); ``fp8_weight``: the weight's cached cast.
    """
    if async_grad_allreduce and groups.tp_size > 1 and torch.is_grad_enabled():
        return _LinearWithGradAccumulationAndAsyncCommunication.apply(x, weight, bias, groups.tp_group,
                                                                      sequence_parallel, main_grad, fp8, fp8_weight)
    return linear(column_parallel_input(x, groups, sequence_parallel), weight, bias, main_grad, fp8, fp8_weight)


def _divide(n: int, tp: int, what: str, key: str) -> int:
    if n % tp != 0:
        raise ConfigError(f"model: {what} {n} is not divisible by tensor_model_parallel_size={tp}; change {key} or the TP size")
    return n // tp


class _TensorParallelLinear(torch.nn.Module):
    """What the column- and row-parallel linears share: the weight ``[out, in]`` sharded on
    ``_weight_spec.partition_dim`` (0: the output dim, column-parallel; 1: the input dim, row-parallel),
    its shard specs, gradient accumulation fusion and the FP8 hooks (`mptrain.layers.fp8.UsesFp8`).

    Subclasses set ``weight``, ``bias`` (or None), ``_weight_spec``, ``_bias_spec`` (with a bias), ``groups``,
    ``weight_main_grad``, ``fp8`` and ``fp8_weight_cast`` in ``__init__``.
    """

    def local_shard_specs(self) -> dict:
        specs = {"weight": self._weight_spec}
        if self.bias is not None:
            specs["bias"] = self._bias_spec
        return specs

    def fuse_grad_accumulation(self, main_grad: MainGradOf) -> None:
        """`mptrain.layers.grad_accumulation_fusion.FusesGradAccumulation`: backward accumulates the
        weight grad into ``main_grad(self.weight)`` (``weight_main_grad``)."""
        self.weight_main_grad = main_grad(self.weight)

    def fp8_decision(self, recipe: Fp8Recipe) -> str:
        """`mptrain.layers.fp8.UsesFp8`: `fp8_gemm_decision` on the global ``[out, in]`` and this rank's shard."""
        return fp8_gemm_decision(recipe, global_shape=tuple(self._weight_spec.global_shape),
                                 local_shape=tuple(self.weight.shape))

    def enable_fp8(self, recipe: Fp8Recipe, *, cache_weight_cast: bool = True) -> str:
        """`mptrain.layers.fp8.UsesFp8`: compute in FP8 if `fp8_decision` says so. Returns the decision.

        The amax of a TP-sharded operand is all-reduced over TP (every layout scales as tp1): the output
        (and its grad) of a column-parallel linear, the input of a row-parallel one; under context parallelism
        an activation's amax over tokens is all-reduced over CP too (every layout scales as cp1).
        ``cache_weight_cast`` False: no `Fp8WeightCast` (the weight is whole only inside the forward, ZeRO-2 /
        ZeRO-3): each GEMM casts the weight it is given."""
        decision = self.fp8_decision(recipe)
        if decision == IN_FP8:
            tp = self.groups.tp_size > 1
            column = self._weight_spec.partition_dim == 0
            cp = getattr(self.groups, "cp_size", 1) > 1
            self.fp8 = fp8_gemms(recipe, amax_group=self.groups.tp_group if tp else None,
                                 input_sharded=tp and not column, output_sharded=tp and column,
                                 token_group=self.groups.cp_group if cp else None)
            self.fp8_weight_cast = Fp8WeightCast.for_linear(self.fp8, self.weight) if cache_weight_cast else None
        return decision

    def _cached_fp8_weight(self) -> Optional[Fp8WeightCast]:
        cast = self.fp8_weight_cast
        return cast if cast is not None and cast.current else None


class ColumnParallelLinear(_TensorParallelLinear):
    """Y = X A + b with A split along its output columns: A = [A_1 ... A_tp], rank r holds A_r.

    Shapes: input ``[s, b, in]`` (or ``[s/tp, b, in]`` under ``context.sequence_parallel``:
    all-gathered on the sequence first), output ``[s, b, out/tp]`` (``[s, b, out]`` with ``gather_output``). Weight
    ``[out/tp, in]``, bias ``[out/tp]`` (both TP-sharded on dim 0).

    ``parts`` > 1 (SwiGLU's fused [gate; up]) splits the global output dim into ``parts`` equal
    blocks first and shards each block, so the layout-independent weight stays ``[gate; up]``
    (`ShardSpec.interleave`).

    Args:
        input_size, output_size: global sizes (elements).
        context: `LayerContext`: groups, init, sequence_parallel (the input is sequence-sharded),
            params_dtype, device, async_tensor_model_parallel_allreduce (overlap the backward
            input-grad collective with the weight-grad GEMM, `column_parallel_linear`).
        name: the global parameter prefix (e.g. ``decoder.layers.3.mlp.linear_fc1``), which seeds the init.
        bias: add a bias. gather_output: all-gather the output on the last dim.
        skip_bias_add: return the bias instead of adding it. scaled_init: use std / sqrt(2 L).

    ``weight_main_grad`` (None unless set by the DDP wrapper under
    ``parallel.gradient_accumulation_fusion``): the weight's ``main_grad`` view, into which
    backward accumulates the weight grad (`grad_accumulation`).
    ``fp8`` (None unless `enable_fp8` turned it on, ``precision=fp8``): the `mptrain.layers.fp8.Fp8Gemms`
    its three GEMMs run through; ``fp8_weight_cast`` (tensorwise): the weight's FP8 cast, made once per
    optimizer step by `mptrain.layers.fp8.Fp8WeightCasts` and used while it is current.
    Raises:
        ConfigError: output_size not divisible by tp × parts.
    """

    def __init__(self, input_size: int, output_size: int, *, context: LayerContext, name: str, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False, scaled_init: bool = False,
                 parts: int = 1) -> None:
        super().__init__()
        groups, init, sequence_parallel = context.groups, context.init, context.sequence_parallel
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output with sequence_parallel is not supported")
        tp = groups.tp_size
        self.groups, self.gather_output, self.skip_bias_add = groups, gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.async_grad_allreduce = context.async_tensor_model_parallel_allreduce
        self.input_size, self.output_size, self.parts = input_size, output_size, parts
        part_local = _divide(output_size // parts, tp, f"{name} output size / {parts} =", "hidden sizes")
        self.output_size_per_partition = part_local * parts
        device, params_dtype = context.device, context.params_dtype
        self._weight_spec = ShardSpec(global_shape=(output_size, input_size), partition_dim=0,
                                      offset=groups.tp_rank * part_local,
                                      valid=None if parts > 1 else part_local, interleave=parts)
        full = init.normal(f"{name}.weight", (output_size, input_size), scaled=scaled_init)
        w = take_shard(full, self._weight_spec, self.output_size_per_partition)
        self.weight = torch.nn.Parameter(w.to(device=device, dtype=params_dtype))
        if bias:
            self._bias_spec = ShardSpec(global_shape=(output_size,), partition_dim=0, offset=groups.tp_rank * part_local,
                                        valid=None if parts > 1 else part_local, interleave=parts, no_weight_decay=True)
            self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition, device=device, dtype=params_dtype))
        else:
            self.register_parameter("bias", None)
        self.weight_main_grad: Optional[torch.Tensor] = None
        self.fp8: Optional[Fp8Gemms] = None
        self.fp8_weight_cast: Optional[Fp8WeightCast] = None

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        y = column_parallel_linear(x, self.weight, bias, self.groups, self.sequence_parallel,
                                   self.async_grad_allreduce, self.weight_main_grad, self.fp8,
                                   self._cached_fp8_weight())  # [s, b, out/tp]
        if self.gather_output:
            y = gather_from_tp_region(y, self.groups.tp_group)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_TensorParallelLinear):
    """Y = X A + b with A split along its input rows: A = [A_1; ...; A_tp], X = [X_1 ... X_tp].

    Y = sum_r X_r A_r: each rank computes a partial ``[s, b, out]``, then g all-reduces it (or,
    under SP, reduce-scatters it to ``[s/tp, b, out]``). The bias is added after the reduction, so
    it is replicated over TP (under SP its grad must be all-reduced over TP:
    ``sequence_parallel_grad``). Weight ``[out, in/tp]`` (TP-sharded on dim 1).

    Args:
        input_is_parallel: the input is already ``[s, b, in/tp]`` (from a column-parallel
            layer); otherwise it is scattered on the last dim first. Must be True under SP.
        others: as `ColumnParallelLinear` (``weight_main_grad``, ``fp8`` and ``fp8_weight_cast`` too).
    Raises:
        ConfigError: input_size not divisible by tp.
    """

    def __init__(self, input_size: int, output_size: int, *, context: LayerContext, name: str, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False, scaled_init: bool = True) -> None:
        super().__init__()
        groups, init, sequence_parallel = context.groups, context.init, context.sequence_parallel
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        tp = groups.tp_size
        self.groups, self.input_is_parallel, self.skip_bias_add = groups, input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.input_size_per_partition = _divide(input_size, tp, f"{name} input size", "hidden sizes")
        device, params_dtype = context.device, context.params_dtype
        self._weight_spec = ShardSpec(global_shape=(output_size, input_size), partition_dim=1,
                                      offset=groups.tp_rank * self.input_size_per_partition,
                                      valid=self.input_size_per_partition)
        full = init.normal(f"{name}.weight", (output_size, input_size), scaled=scaled_init)
        w = full.narrow(1, groups.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        self.weight = torch.nn.Parameter(w.contiguous().to(device=device, dtype=params_dtype))
        if bias:
            self._bias_spec = ShardSpec(global_shape=(output_size,), no_weight_decay=True,
                                        sequence_parallel_grad=sequence_parallel)
            self.bias = torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=params_dtype))
        else:
            self.register_parameter("bias", None)
        self.weight_main_grad: Optional[torch.Tensor] = None
        self.fp8: Optional[Fp8Gemms] = None
        self.fp8_weight_cast: Optional[Fp8WeightCast] = None

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.groups.tp_group)
        partial = linear(x, self.weight, None, self.weight_main_grad, self.fp8,
                         self._cached_fp8_weight())  # [s, b, out], partial over TP
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.groups.tp_group)  # [s/tp, b, out]
        else:
            y = reduce_from_tp_region(partial, self.groups.tp_group, inplace=True)  # partial: fresh, read by no one else
        if self.skip_bias_add or self.bias is None:
            return y, self.bias
        return y + self.bias, None
