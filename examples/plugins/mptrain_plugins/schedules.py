"""A user's pipeline schedule: GPipe written against mptrain's public schedule interface.

Select it with ``schedule._target_=mptrain_plugins.schedules.my_gpipe`` (docs/COMPONENTS.md
"Pipeline schedule"). It uses only `mptrain.schedules`' public pieces: the `ScheduleSpec` it is
given, the shared `forward_step` / `backward_step` (which apply the loss normalisation contract),
`no_sync_context` for the DP wrapper, and the `p2p` helpers; so it computes the same numbers as the
built-in ``schedule=gpipe``, bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from mptrain.errors import ConfigError
from mptrain.schedules import (
    InflightCounter,
    PipelineLayout,
    ScheduleSpec,
    ScheduleStats,
    backward_step,
    forward_step,
    new_step_state,
    no_sync_context,
    p2p,
)


def check_my_gpipe_layout(layout: PipelineLayout) -> None:
    """One model chunk per rank: reject a virtual pipeline at start-up (before any process group exists)."""
    vpp = layout.virtual_pipeline_model_parallel_size
    if vpp:
        raise ConfigError(f"parallel.virtual_pipeline_model_parallel_size={vpp}: mptrain_plugins.schedules.my_gpipe "
                          "runs one model chunk per rank; set it to null or pick schedule=interleaved_1f1b")


def my_gpipe(
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
    """All m forwards (receive, compute, send on), then all m backwards in the same order."""
    groups, m = spec.groups, spec.num_microbatches
    if len(model) != 1:
        raise ConfigError(f"schedule: my_gpipe runs one model chunk per rank, got {len(model)}")
    chunk = model[0]
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    stats = None if forward_only else stats  # stats describe training iterations only
    cfg = p2p.P2PConfig(groups=groups, tensor_shape=spec.tensor_shape, dtype=spec.dtype, stats=stats)
    is_last = groups.pp_rank == groups.pp_size - 1
    state = new_step_state(groups.device)
    inflight = InflightCounter(stats)
    saved: list = []  # (input, output) per micro-batch, FIFO

    with torch.no_grad() if forward_only else contextlib.nullcontext():
        for _ in range(m):
            input_tensor = p2p.recv_forward(cfg)
            output = forward_step(forward_step_func, data_iterator, chunk, input_tensor, is_last_stage=is_last,
                                  state=state, loss_scale=loss_scale, max_tokens=spec.max_tokens,
                                  forward_only=forward_only)
            p2p.send_forward(output, cfg)
            if not forward_only:
                saved.append((input_tensor, output))
                inflight.push()
            del input_tensor, output

    if not forward_only:
        for i in range(m):
            input_tensor, output = saved.pop(0)
            output_grad = p2p.recv_backward(cfg)
            with no_sync_context(no_sync_func, 0, sync=i == m - 1):  # DP sync on the last backward only
                input_grad = backward_step(input_tensor, output, output_grad)
            del input_tensor, output, output_grad
            inflight.pop()
            p2p.send_backward(input_grad, cfg)
            del input_grad
    if stats is not None:
        stats.calls += 1
    return state.reports, state.num_tokens


my_gpipe.check_layout = check_my_gpipe_layout

