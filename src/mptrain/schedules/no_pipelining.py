"""No pipelining: gradient accumulation over micro-batches on one stage (Megatron ``forward_backward_no_pipelining``)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from mptrain.errors import ConfigError
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


def check_no_pipelining_layout(layout: PipelineLayout) -> None:
    """No pipelining runs one stage: pp must be 1 (`ForwardBackwardFunc.check_layout`).

    Raises:
        ConfigError: pipeline_model_parallel_size > 1.
    """
    pp = layout.pipeline_model_parallel_size
    if pp > 1:
        raise ConfigError(
            f"schedule=no_pipelining cannot run pipeline_model_parallel_size={pp}; pick schedule=auto, 1f1b or gpipe"
        )


def forward_backward_no_pipelining(
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
    """Run ``spec.num_microbatches`` forward+backward passes back to back on the single stage (pp = 1).

    Each micro-batch's activations are freed by its own backward before the next forward, so at
    most one micro-batch is in flight. All micro-batches but the last run under ``no_sync_func()``
    so the DP gradient sync happens once, during/after the last backward. Nothing is communicated,
    so ``spec.tensor_shape`` is unused.

    Args / Returns: see `mptrain.schedules.ForwardBackwardFunc`.
    Raises:
        ConfigError: pp > 1, num_microbatches < 1, or more than one model chunk.
    """
    check_no_pipelining_layout(spec.layout)
    validate_common(spec, name="no_pipelining", model=model, expected_chunks=1, forward_only=forward_only)
    stats = None if forward_only else stats  # stats describe training iterations only
    chunk = model[0]
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    state = new_step_state(spec.groups.device)
    inflight = InflightCounter(stats)
    num_microbatches = spec.num_microbatches
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for i in range(num_microbatches):
            last = i == num_microbatches - 1
            with no_sync_context(no_sync_func, 0, sync=last or forward_only):
                output = forward_step(forward_step_func, data_iterator, chunk, None, is_last_stage=True, state=state,
                                      loss_scale=loss_scale, max_tokens=spec.max_tokens, forward_only=forward_only)
                inflight.push()
                if not forward_only:
                    backward_step(None, output, None)
                del output
                inflight.pop()
    if stats is not None:
        stats.calls += 1
    return state.reports, state.num_tokens


forward_backward_no_pipelining.check_layout = check_no_pipelining_layout


def one_chunk_layout_rule(name: str) -> Callable:
    """The `check_layout` of a schedule that runs one model chunk per rank (gpipe, 1f1b).

    The returned rule: a virtual pipeline (vpp > 1) needs the interleaved schedule (ConfigError naming
    ``virtual_pipeline_model_parallel_size``); with one stage the schedule degenerates to no_pipelining
    (no warmup, no p2p; Megatron's ``get_forward_backward_func`` does the same), which it returns.
    """

    def check_layout(layout) -> Optional[Callable]:
        vpp = layout.virtual_pipeline_model_parallel_size
        if vpp:
            raise ConfigError(
                f"parallel.virtual_pipeline_model_parallel_size={vpp} needs schedule=interleaved_1f1b or auto "
                f"(got schedule={name}); pick schedule=auto or a parallel= without vpp"
            )
        if layout.pipeline_model_parallel_size == 1:
            return forward_backward_no_pipelining
        return None

    check_layout.__qualname__ = check_layout.__name__ = f"check_{name}_layout"
    return check_layout
