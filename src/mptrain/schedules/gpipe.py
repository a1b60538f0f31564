"""GPipe: all forwards, then all backwards (Huang et al. 2019, "GPipe", §2.2; no Megatron counterpart)."""

from __future__ import annotations

import contextlib
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


def forward_backward_gpipe(
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
    """Fill the pipeline with all m forwards, then drain it with all m backwards (same micro-batch order).

    Every stage stores the activations of all m micro-batches at the turn (``max_inflight = m``),
    which is what 1F1B avoids; the bubble fraction is the same, (pp − 1) / (m + pp − 1).

    Args / Returns / Raises: see `mptrain.schedules.ForwardBackwardFunc`.
    """
    validate_common(spec, name="gpipe", model=model, expected_chunks=1, forward_only=forward_only)
    setup = p2p.single_chunk_setup(spec, model=model, data_iterator=data_iterator, stats=stats, forward_only=forward_only)
    groups, num_microbatches, max_tokens = spec.groups, spec.num_microbatches, spec.max_tokens
    chunk, data_iterator, cfg, is_last, stats = setup.chunk, setup.data_iterator, setup.cfg, setup.is_last, setup.stats
    state = new_step_state(groups.device)
    inflight = InflightCounter(stats)
    input_tensors: list = []
    output_tensors: list = []

    # --- all forwards ---
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for _ in range(num_microbatches):
            input_tensor = p2p.recv_forward(cfg)
            output = forward_step(forward_step_func, data_iterator, chunk, input_tensor, is_last_stage=is_last,
                                  state=state, loss_scale=loss_scale, max_tokens=max_tokens, forward_only=forward_only)
            p2p.send_forward(output, cfg)
            if not forward_only:
                input_tensors.append(input_tensor)
                output_tensors.append(output)
                inflight.push()
            del input_tensor, output

    # --- all backwards (FIFO, so the last stage can start on micro-batch 0 at once) ---
    if not forward_only:
        for i in range(num_microbatches):
            input_tensor, output = input_tensors.pop(0), output_tensors.pop(0)
            output_grad = p2p.recv_backward(cfg)
            with no_sync_context(no_sync_func, 0, sync=i == num_microbatches - 1):
                input_grad = backward_step(input_tensor, output, output_grad)
            del input_tensor, output, output_grad  # free this micro-batch's activations
            inflight.pop()
            p2p.send_backward(input_grad, cfg)
            del input_grad
    if stats is not None:
        stats.calls += 1
    return state.reports, state.num_tokens


forward_backward_gpipe.check_layout = one_chunk_layout_rule("gpipe")  # no vpp; pp = 1 runs no_pipelining
