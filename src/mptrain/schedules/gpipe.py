"""GPipe: all forwards, then all backwards (Huang et al. 2019, "GPipe", §2.2; no Megatron counterpart)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from mptrain.groups import ParallelGroups
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


def forward_backward_gpipe(
    *,
    forward_step_func: Callable,
    data_iterator: Any,
    model: list,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    groups: ParallelGroups,
    dtype: torch.dtype,
    sequence_parallel: bool,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    max_tokens: int,
    no_sync_func: Optional[Callable] = None,
    stats: Optional[ScheduleStats] = None,
) -> tuple[list, torch.Tensor]:
    """Fill the pipeline with all m forwards, then drain it with all m backwards (same micro-batch order).

    Every stage stores the activations of all m micro-batches at the turn (``max_inflight = m``),
    which is what 1F1B avoids; the bubble fraction is the same, (pp − 1) / (m + pp − 1).

    Args / Returns / Raises: see `mptrain.schedules.get_forward_backward_func`.
    """
    validate_common(name="gpipe", model=model, num_microbatches=num_microbatches, max_tokens=max_tokens,
                    expected_chunks=1, forward_only=forward_only)
    setup = p2p.single_chunk_setup(model=model, data_iterator=data_iterator, groups=groups, seq_length=seq_length,
                                   micro_batch_size=micro_batch_size, hidden_size=hidden_size,
                                   sequence_parallel=sequence_parallel, dtype=dtype, stats=stats,
                                   forward_only=forward_only)
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
