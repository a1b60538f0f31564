"""Interleaved 1F1B over virtual pipeline stages (Megatron ``forward_backward_pipelining_with_interleaving``).

Narayanan et al. 2021, §2.2.2. Each of the pp ranks holds vpp model chunks; chunk c on rank r is
virtual stage ``c·pp + r``, so activations go rank 0 → 1 → … → pp−1 → (wrap) rank 0 of the next
chunk. Micro-batches are processed in groups of pp per chunk: forward step k runs chunk
``(k mod pp·vpp) // pp`` on micro-batch ``(k // (pp·vpp))·pp + k mod pp``; backward steps visit the
chunks in reverse. This is Megatron's table with ``microbatch_group_size_per_vp_stage = pp``,
which needs ``num_microbatches % pp == 0`` (core_v0.5–v0.9; later versions relax it only for
other group sizes). Warmup on rank r: ``2·(pp − r − 1) + (vpp − 1)·pp`` forwards (all of them when
m = pp), then steady 1F1B, then cooldown. The bubble shrinks by a factor vpp against 1F1B.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from mptrain.errors import ConfigError
from mptrain.schedules import p2p
from mptrain.schedules.common import (
    InflightCounter,
    ScheduleStats,
    backward_step,
    forward_step,
    new_step_state,
    no_sync_context,
    validate_common,
)
from mptrain.schedules.interface import PipelineLayout, ScheduleSpec


def check_interleaved_layout(layout: PipelineLayout) -> None:
    """What the interleaved table can schedule (`ForwardBackwardFunc.check_layout`; also checked per call).

    Raises:
        ConfigError: vpp unset or 1 (pp = 1 with vpp is rejected with the layout, `mptrain.groups.validate_layout`),
            or ``num_microbatches`` not a multiple of pp.
    """
    pp, vpp, m = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size, layout.num_microbatches
    if not vpp or vpp < 2 or pp < 2:
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size is {'null' if vpp is None else vpp} but schedule=interleaved_1f1b "
            f"needs it > 1 (with pipeline_model_parallel_size={pp}); pick parallel=tp1pp2vpp2 (or another vpp layout) "
            f"or schedule=1f1b"
        )
    if m % pp != 0:
        mbs, dp = layout.micro_batch_size, layout.data_parallel_size
        raise ConfigError(
            f"schedule=interleaved_1f1b needs num_microbatches % pipeline_model_parallel_size == 0, got "
            f"{m} micro-batches (train.global_batch_size={layout.global_batch_size} / "
            f"(micro_batch_size {mbs} × dp {dp})) and pp={pp}; make global_batch_size a multiple "
            f"of {mbs * dp * pp}"
        )


def forward_backward_interleaved_1f1b(
    spec: ScheduleSpec,
    *,
    forward_step_func: Callable,
    data_iterator: Any,
    model: list,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    no_sync_func: Any = None,
    stats: Optional[ScheduleStats] = None,
) -> tuple[list, torch.Tensor]:
    """Interleaved 1F1B: ``model`` and ``data_iterator`` are lists with one entry per virtual chunk.

    ``no_sync_func``: one factory for all chunks or a list (one per chunk); the last backward of
    each chunk runs with DP sync enabled.

    Args / Returns: see `mptrain.schedules.ForwardBackwardFunc`.
    Raises:
        ConfigError: see `check_interleaved_layout`; the number of chunks or data iterators is not vpp.
    """
    groups, num_microbatches, max_tokens = spec.groups, spec.num_microbatches, spec.max_tokens
    pp, vpp, rank = groups.pp_size, groups.vpp_size, groups.pp_rank
    validate_common(spec, name="interleaved_1f1b", model=model, expected_chunks=vpp or 1, forward_only=forward_only)
    check_interleaved_layout(spec.layout)
    stats = None if forward_only else stats  # stats describe training iterations only
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != vpp:
        raise ConfigError(f"schedule=interleaved_1f1b: data_iterator must be a list of {vpp} iterators (one per chunk)")
    cfg = p2p.P2PConfig(groups=groups, tensor_shape=spec.tensor_shape, dtype=spec.dtype, stats=stats)
    state = new_step_state(groups.device)
    inflight = InflightCounter(stats)
    m = num_microbatches
    total = m * vpp
    group = pp * vpp
    first_rank, last_rank = rank == 0, rank == pp - 1

    if forward_only:
        num_warmup, all_warmup = total, False
    elif m == pp:
        num_warmup, all_warmup = total, True
    else:
        num_warmup, all_warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total), False
    num_steady = total - num_warmup

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % group) // pp
        return c if forward else vpp - 1 - c

    def microbatch_id(k: int) -> int:
        return (k // group) * pp + k % pp

    input_tensors: list = [[] for _ in range(vpp)]
    output_tensors: list = [[] for _ in range(vpp)]
    output_grads: list = [[] for _ in range(vpp)]

    def fwd(k: int) -> torch.Tensor:
        c = chunk_id(k, forward=True)
        if groups.is_pipeline_first_stage(vp_stage=c) and len(input_tensors[c]) == len(output_tensors[c]):
            input_tensors[c].append(None)
        output = forward_step(forward_step_func, data_iterator[c], model[c], input_tensors[c][-1],
                              is_last_stage=groups.is_pipeline_last_stage(vp_stage=c), state=state,
                              loss_scale=loss_scale, max_tokens=max_tokens, forward_only=forward_only)
        if forward_only:
            input_tensors[c].pop()  # nothing is kept for a backward
        else:
            output_tensors[c].append(output)
            inflight.push()
        return output

    def bwd(k: int) -> Optional[torch.Tensor]:
        c = chunk_id(k, forward=False)
        if groups.is_pipeline_last_stage(vp_stage=c) and not output_grads[c]:
            output_grads[c].append(None)
        input_tensor, output, output_grad = input_tensors[c].pop(0), output_tensors[c].pop(0), output_grads[c].pop(0)
        with no_sync_context(no_sync_func, c, sync=microbatch_id(k) == m - 1):
            input_grad = backward_step(input_tensor, output, output_grad)
        inflight.pop()
        return input_grad

    with torch.no_grad() if forward_only else torch.enable_grad():
        # --- warmup ---
        input_tensors[0].append(p2p.recv_forward(cfg))
        for k in range(num_warmup):
            output = fwd(k)
            next_c = chunk_id(k + 1, forward=True)
            recv_prev = not (first_rank and next_c == 0) and k != total - 1
            if groups.is_pipeline_last_stage(vp_stage=chunk_id(k, forward=True)):
                output = None  # the loss stays here
            if k == num_warmup - 1 and not forward_only and not all_warmup:
                input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                    output, None, cfg, recv_prev=recv_prev, recv_next=not last_rank)
                output_grads[vpp - 1].append(output_grad)
            else:
                input_tensor = p2p.send_forward_recv_forward(output, cfg, recv_prev=recv_prev)
            if recv_prev:
                input_tensors[next_c].append(input_tensor)
            del output, input_tensor

        # --- steady state: forward k + num_warmup, backward k ---
        for k in range(num_steady):
            forward_k = k + num_warmup
            output = fwd(forward_k)
            input_grad = bwd(k)
            if groups.is_pipeline_last_stage(vp_stage=chunk_id(forward_k, forward=True)):
                output = None
            if groups.is_pipeline_first_stage(vp_stage=chunk_id(k, forward=False)):
                input_grad = None
            # which chunk the next received activation / grad belongs to (Megatron's bookkeeping)
            recv_prev = True
            if first_rank:
                next_fc = chunk_id(forward_k - (pp - 1), forward=True)
                if next_fc == vpp - 1:
                    recv_prev = False
                next_fc += 1
            else:
                next_fc = chunk_id(forward_k + 1, forward=True)
            recv_next = True
            if last_rank:
                next_bc = chunk_id(k - (pp - 1), forward=False)
                if next_bc == 0:
                    recv_next = False
                next_bc -= 1
            else:
                next_bc = chunk_id(k + 1, forward=False)
            if k == num_steady - 1:
                recv_prev = False
            input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                output, input_grad, cfg, recv_prev=recv_prev, recv_next=recv_next)
            if recv_prev:
                input_tensors[next_fc].append(input_tensor)
            if recv_next:
                output_grads[next_bc].append(output_grad)
            del output, input_grad, input_tensor, output_grad

        # --- cooldown: the outstanding backwards ---
        if not forward_only:
            if all_warmup:
                output_grads[vpp - 1].append(p2p.recv_backward(cfg))
            for k in range(num_steady, total):
                input_grad = bwd(k)
                if groups.is_pipeline_first_stage(vp_stage=chunk_id(k, forward=False)):
                    input_grad = None
                next_bc = chunk_id(k + 1, forward=False)
                recv_next = not (last_rank and next_bc == vpp - 1) and k != total - 1
                output_grad = p2p.send_backward_recv_backward(input_grad, cfg, recv_next=recv_next)
                if recv_next:
                    output_grads[next_bc].append(output_grad)
                del input_grad, output_grad
    if stats is not None:
        stats.calls += 1
    return state.reports, state.num_tokens


forward_backward_interleaved_1f1b.check_layout = check_interleaved_layout
