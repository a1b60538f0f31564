"""1F1B: one forward, one backward (PipeDream-Flush; Megatron ``forward_backward_pipelining_without_interleaving``).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §2.2.1. Stage r of pp runs ``warmup = min(pp − r − 1, m)`` forwards, then alternates
one forward and one backward for the remaining ``m − warmup`` micro-batches (steady state), then
runs the ``warmup`` outstanding backwards (cooldown). Stage r thus holds at most
``min(pp − r, m)`` micro-batches of activations, against m for GPipe.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

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
from mptrain.schedules.interface import ScheduleSpec
from mptrain.schedules.no_pipelining import one_chunk_layout_rule


def forward_backward_1f1b(
    spec: ScheduleSpec,
    *,
    forward_step_func: Callable,
    data_iterator: Any,
    model: list,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    no_sync_func: Optional[Callable] = None,
    stats: Optional[ScheduleStats] = None,
) -> tuple[list, torch.Tensor]:
    """The non-interleaved 1F1B schedule over ``num_microbatches`` micro-batches (any m >= 1).

    Args / Returns / Raises: see `mptrain.schedules.ForwardBackwardFunc`.
    """
    validate_common(spec, name="1f1b", model=model, expected_chunks=1, forward_only=forward_only)
    setup = p2p.single_chunk_setup(spec, model=model, data_iterator=data_iterator, stats=stats, forward_only=forward_only)
    groups, num_microbatches, max_tokens = spec.groups, spec.num_microbatches, spec.max_tokens
    chunk, data_iterator, cfg, is_last, stats = setup.chunk, setup.data_iterator, setup.cfg, setup.is_last, setup.stats
    state = new_step_state(groups.device)
    inflight = InflightCounter(stats)
    m = num_microbatches
    num_warmup = m if forward_only else min(groups.pp_size - groups.pp_rank - 1, m)
    num_steady = m - num_warmup
    input_tensors: list = []
    output_tensors: list = []

    def fwd(input_tensor):
        return forward_step(forward_step_func, data_iterator, chunk, input_tensor, is_last_stage=is_last,
                            state=state, loss_scale=loss_scale, max_tokens=max_tokens, forward_only=forward_only)

    def bwd(output_grad, sync: bool):
        input_tensor, output = input_tensors.pop(0), output_tensors.pop(0)
        with no_sync_context(no_sync_func, 0, sync=sync):
            input_grad = backward_step(input_tensor, output, output_grad)
        inflight.pop()  # input_tensor / output dropped here: the micro-batch's graph is freed
        return input_grad

    if forward_only:  # evaluation: every stage just streams its m forwards
        with torch.no_grad():
            for _ in range(m):
                p2p.send_forward(fwd(p2p.recv_forward(cfg)), cfg)
        if stats is not None:
            stats.calls += 1
        return state.reports, state.num_tokens

    # --- warmup: pp − r − 1 forwards ---
    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward(cfg)
        output = fwd(input_tensor)
        p2p.send_forward(output, cfg)
        input_tensors.append(input_tensor)
        output_tensors.append(output)
        inflight.push()

    # --- steady state: one forward, one backward ---
    input_tensor = p2p.recv_forward(cfg) if num_steady > 0 else None
    for i in range(num_steady):
        last_iteration = i == num_steady - 1
        output = fwd(input_tensor)
        output_grad = p2p.send_forward_recv_backward(output, cfg)
        input_tensors.append(input_tensor)
        output_tensors.append(output)
        inflight.push()
        del input_tensor, output
        # the DP sync is enabled for the very last backward: here when there is no cooldown
        input_grad = bwd(output_grad, sync=last_iteration and num_warmup == 0)
        del output_grad
        if last_iteration:
            p2p.send_backward(input_grad, cfg)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, cfg)  # noqa: F841 - the next iteration's forward reads it
        del input_grad

    # --- cooldown: the warmup's outstanding backwards ---
    for i in range(num_warmup):
        output_grad = p2p.recv_backward(cfg)
        input_grad = bwd(output_grad, sync=i == num_warmup - 1)
        del output_grad
        p2p.send_backward(input_grad, cfg)
        del input_grad
    if stats is not None:
        stats.calls += 1
    return state.reports, state.num_tokens


forward_backward_1f1b.check_layout = one_chunk_layout_rule("1f1b")  # no vpp; pp = 1 runs no_pipelining
