"""What every pipeline schedule shares: validation, one forward step, one backward step, stats.

Activation layout: ``[s, b, h]`` (sequence, micro-batch, hidden) between stages; ``s`` is
``seq_length / tp`` under sequence parallelism. Token tensors (inside ``forward_step_func``) are ``[b, s]``.

Loss normalisation (derived once, here; docs/ARCHITECTURE.md "Loss normalisation"):
the training loss is the mean over all loss-masked tokens of the global batch,
``L = Σ_mb loss_sum_mb / N``, with ``N`` the DP-reduced token count, unknown until every
micro-batch has run. Each micro-batch therefore backpropagates
``loss_sum_mb · loss_scale / max_tokens`` with the constant ``max_tokens = global_batch_size ×
seq_length`` (keeps fp16 grads mean-sized), and the caller's ``finalize_model_grads`` multiplies
the accumulated grads by ``max_tokens / N``. The schedule never divides by ``num_microbatches``,
so the result does not depend on how the global batch is cut into micro-batches or DP ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from mptrain.errors import ConfigError


@dataclasses.dataclass
class ScheduleStats:
    """Observations of the schedules on this rank, accumulated over training calls (the caller owns and resets it).

    Forward-only (evaluation) calls leave it untouched, so ``bytes_sent / calls`` is per training iteration.

    Attributes:
        max_inflight_microbatches: the largest number of micro-batches (forward passes, summed over
            virtual chunks) whose activations were held at once, waiting for their backward.
            1F1B: min(pp − stage, m); GPipe: m; no pipelining: 1 (layout.json, DESIGN.md §2).
        bytes_sent: bytes handed to send operations, by group kind ("pp" here), summed over calls.
        calls: how many schedule calls (iterations) contributed, for per-iteration averages.
        timers: a `mptrain.training.timers.Timers` (or None): p2p exchanges run under its
            "pipeline-p2p" timer.
    """

    max_inflight_microbatches: int = 0
    bytes_sent: dict = dataclasses.field(default_factory=lambda: {"pp": 0})
    timers: Any = None
    calls: int = 0

    def note_inflight(self, n: int) -> None:
        self.max_inflight_microbatches = max(self.max_inflight_microbatches, n)

    def add_bytes_sent(self, kind: str, nbytes: int) -> None:
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + int(nbytes)


class InflightCounter:
    """Counts micro-batches whose activations are stored on this rank; reports the peak into stats."""

    def __init__(self, stats: Optional[ScheduleStats]) -> None:
        self.stats = stats
        self.current = 0

    def push(self) -> None:
        self.current += 1
        if self.stats is not None:
            self.stats.note_inflight(self.current)

    def pop(self) -> None:
        self.current -= 1


def validate_common(spec: Any, *, name: str, model: Sequence[torch.nn.Module], expected_chunks: int,
                    forward_only: bool = False) -> None:
    """Checks of the call every schedule makes before its first communication (identical on every rank, so no hang).

    Args:
        spec: the `mptrain.schedules.ScheduleSpec` of the call.
    Raises:
        ConfigError: ``spec.num_microbatches`` < 1 or not an int, ``spec.max_tokens`` < 1 on a training
            call, or the number of model chunks differs from what the schedule runs (1, or vpp for interleaved).
    """
    num_microbatches, max_tokens = spec.num_microbatches, spec.max_tokens
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(
            f"schedule={name}: num_microbatches={num_microbatches!r} must be an int >= 1; make "
            "train.global_batch_size a multiple of train.micro_batch_size × data-parallel size"
        )
    if not forward_only and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"schedule={name}: max_tokens={max_tokens!r} must be global_batch_size × seq_length >= 1")
    if len(model) != expected_chunks:
        raise ConfigError(
            f"schedule={name}: got {len(model)} model chunks, expected {expected_chunks} "
            "(parallel.virtual_pipeline_model_parallel_size); use schedule=auto"
        )


def set_input_tensor(chunk: torch.nn.Module, tensor: Optional[torch.Tensor]) -> None:
    """Call ``set_input_tensor`` on the chunk, looking through ``.module`` wrappers (DDP, Float16Module)."""
    inner = chunk
    while not hasattr(inner, "set_input_tensor") and hasattr(inner, "module"):
        inner = inner.module
    inner.set_input_tensor(tensor)


def no_sync_context(no_sync_func: Any, chunk_id: int, sync: bool):
    """The context a backward runs under: ``no_sync_func[chunk]()`` unless this backward should sync grads.

    ``no_sync_func`` is None, one context-manager factory (used for every chunk) or a list of them
    (one per chunk). Only the last micro-batch's backward of each chunk runs with DP sync enabled
    (Megatron's ``no_sync_func`` / ``enable_grad_sync`` in schedules.py).
    """
    if no_sync_func is None or sync:
        return contextlib.nullcontext()
    if isinstance(no_sync_func, (list, tuple)):
        return no_sync_func[chunk_id]()
    return no_sync_func()


@dataclasses.dataclass
class StepState:
    """Per-call accumulators of the last stage: reports and the (undivided) token count."""

    reports: list
    num_tokens: torch.Tensor


def new_step_state(device: torch.device) -> StepState:
    return StepState(reports=[], num_tokens=torch.zeros((), dtype=torch.int64, device=device))


def forward_step(
    forward_step_func: Callable,
    data_iterator: Any,
    chunk: torch.nn.Module,
    input_tensor: Optional[torch.Tensor],
    *,
    is_last_stage: bool,
    state: StepState,
    loss_scale: float,
    max_tokens: int,
    forward_only: bool,
) -> torch.Tensor:
    """Run one micro-batch through one model chunk (Megatron ``forward_step``).

    Args:
        input_tensor: ``[s(/tp), b, h]`` received from the previous stage (requires grad), or None on
            the first stage.
        is_last_stage: this chunk computes the loss (last virtual stage of the last rank).
    Returns:
        Not last stage: the output activations ``[s(/tp), b, h]`` to send on.
        Last stage: the scalar to backpropagate, ``loss_sum · loss_scale / max_tokens`` (see the
        module docstring); its loss report is appended to ``state.reports`` and its token count
        added to ``state.num_tokens``.
    """
    set_input_tensor(chunk, input_tensor)
    output, loss_func = forward_step_func(data_iterator, chunk)
    if not is_last_stage:
        return output
    loss_sum, num_tokens, report = loss_func(output)
    state.reports.append(report)
    count = torch.as_tensor(num_tokens).detach().to(device=state.num_tokens.device)
    state.num_tokens += (count.round() if count.is_floating_point() else count).to(torch.int64)  # a mask sum: an integer
    if forward_only:
        return loss_sum.detach()
    return loss_sum * (loss_scale / max_tokens)


def backward_step(input_tensor: Optional[torch.Tensor], output_tensor: torch.Tensor,
                  output_tensor_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Backpropagate one micro-batch through one chunk; return the grad of its input (Megatron ``backward_step``).

    Args:
        input_tensor: the received activations (a leaf that requires grad), or None on the first stage.
        output_tensor: the chunk's output ``[s(/tp), b, h]``, or the scaled scalar loss on the last stage.
        output_tensor_grad: d loss / d output from the next stage (same shape as output), None on the last stage.
    Returns:
        ``[s(/tp), b, h]`` grad of ``input_tensor`` to send to the previous stage, or None on the first stage.
    """
    torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    if input_tensor is None:
        return None
    assert input_tensor.grad is not None, "the chunk did not use its input tensor (set_input_tensor ignored?)"
    return input_tensor.grad
