"""No pipelining: gradient accumulation over micro-batches on one stage (Megatron ``forward_backward_no_pipelining``)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from mptrain.errors import ConfigError
from mptrain.groups import ParallelGroups
from mptrain.schedules.common import (
    InflightCounter,
    ScheduleStats,
    backward_step,
    forward_step,
    new_step_state,
    no_sync_context,
    validate_common,
)


def forward_backward_no_pipelining(
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
    """Run ``num_microbatches`` forward+backward passes back to back on the single stage (pp = 1).

    Each micro-batch's activations are freed by its own backward before the next forward, so at
    most one micro-batch is in flight. All micro-batches but the last run under ``no_sync_func()``
    so the DP gradient sync happens once, during/after the last backward.

    Args: see `mptrain.schedules.get_forward_backward_func` (``seq_length``, ``micro_batch_size``,
        ``hidden_size``, ``dtype``, ``sequence_parallel`` are unused: nothing is communicated).
    Returns:
        (reports: one per micro-batch, num_tokens: int64 scalar, Σ loss-masked tokens).
    Raises:
        ConfigError: pp > 1, num_microbatches < 1, or more than one model chunk.
    """
    if groups.pp_size != 1:
        raise ConfigError(
            f"schedule=no_pipelining needs pipeline_model_parallel_size=1 (got {groups.pp_size}); "
            "use schedule=1f1b, gpipe or auto"
        )
    validate_common(name="no_pipelining", model=model, num_microbatches=num_microbatches, max_tokens=max_tokens,
                    expected_chunks=1, forward_only=forward_only)
    stats = None if forward_only else stats  # stats describe training iterations only
    chunk = model[0]
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    state = new_step_state(groups.device)
    inflight = InflightCounter(stats)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for i in range(num_microbatches):
            last = i == num_microbatches - 1
            with no_sync_context(no_sync_func, 0, sync=last or forward_only):
                output = forward_step(forward_step_func, data_iterator, chunk, None, is_last_stage=True, state=state,
                                      loss_scale=loss_scale, max_tokens=max_tokens, forward_only=forward_only)
                inflight.push()
                if not forward_only:
                    backward_step(None, output, None)
                del output
                inflight.pop()
    if stats is not None:
        stats.calls += 1
    return state.reports, state.num_tokens
