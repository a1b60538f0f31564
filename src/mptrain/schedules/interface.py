"""The pipeline-schedule interface: what a schedule receives (`ScheduleSpec` + per-call arguments), returns,
and may require of the layout (`PipelineLayout`, `check_layout`). docs/COMPONENTS.md "Pipeline schedule".

A schedule is any callable with the `ForwardBackwardFunc` signature, selected by
``schedule._target_`` (a dotted path) and built once by `mptrain.schedules.build_schedule` with
`mptrain.components.build` (``_partial_``: the node's own keys are bound, the trainer passes the
rest per call). The built-in ones live beside this file, one module each; a user's lives in their
package (examples/plugins/mptrain_plugins/schedules.py) and uses the same public helpers.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from mptrain.components import ComponentKind
from mptrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """What a schedule may require of the job, known before any process group exists (pure).

    Built by `mptrain.training.validate.validate_config` from the config and the world size, and by
    `ScheduleSpec.layout` from the groups at run time (the same numbers).

    Attributes:
        tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size: the layout.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank; None when 1 / unset.
        num_microbatches: micro-batches per DP rank per iteration.
        micro_batch_size: sequences per micro-batch (``train.micro_batch_size``).
    """

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    data_parallel_size: int
    num_microbatches: int
    micro_batch_size: int

    @property
    def global_batch_size(self) -> int:
        """Sequences per iteration over all DP ranks: num_microbatches × micro_batch_size × dp."""
        return self.num_microbatches * self.micro_batch_size * self.data_parallel_size


def pipeline_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int, *, tp_size: int,
                          sequence_parallel: bool) -> tuple[int, int, int]:
    """Shape of the activations exchanged between stages: ``[s/tp if sequence_parallel else s, b, h]``.

    ``seq_length % tp == 0`` under sequence parallelism is a config rule checked once, by
    `mptrain.training.validate.validate_config` (naming the keys); here it is an invariant.
    """
    assert not sequence_parallel or seq_length % tp_size == 0, (seq_length, tp_size)
    seq = seq_length // tp_size if sequence_parallel else seq_length
    return (seq, micro_batch_size, hidden_size)


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """Everything fixed for the whole run that a schedule call needs (built once by the trainer).

    Activation layout between stages: ``[s, b, h]`` = `tensor_shape`.

    Attributes:
        groups: the `mptrain.groups.ParallelGroups` of this rank (pp rank/size, vpp, p2p neighbours, device).
        num_microbatches: micro-batches per call on this DP rank (m >= 1).
        seq_length: tokens per sequence (``model.seq_length``).
        micro_batch_size: sequences per micro-batch.
        hidden_size: model width h.
        dtype: dtype of the activations and grads exchanged between stages (the compute dtype).
        sequence_parallel: activations are split along s over TP (only meaningful with tp > 1).
        max_tokens: ``global_batch_size × seq_length``, the constant each micro-batch's loss is
            divided by in a training call (see "Loss normalisation" in `mptrain.schedules.common`);
            may be None for a spec used only for forward-only calls.
    """

    groups: Any
    num_microbatches: int
    seq_length: int
    micro_batch_size: int
    hidden_size: int
    dtype: torch.dtype
    sequence_parallel: bool
    max_tokens: Optional[int]

    @property
    def tensor_shape(self) -> tuple[int, int, int]:
        """``[s/tp if sequence_parallel else s, micro_batch_size, hidden_size]``: what p2p sends and receives
        (s = seq_length / cp: a context-parallel rank holds s/cp tokens of each sequence)."""
        seq = self.seq_length // getattr(self.groups, "cp_size", 1)
        return pipeline_tensor_shape(seq, self.micro_batch_size, self.hidden_size,
                                     tp_size=self.groups.tp_size, sequence_parallel=self.sequence_parallel)

    @property
    def layout(self) -> PipelineLayout:
        """The `PipelineLayout` these groups and counts describe (what `check_layout` saw at start-up)."""
        g = self.groups
        return PipelineLayout(tensor_model_parallel_size=g.tp_size, pipeline_model_parallel_size=g.pp_size,
                              virtual_pipeline_model_parallel_size=g.vpp_size, data_parallel_size=g.dp_size,
                              num_microbatches=self.num_microbatches, micro_batch_size=self.micro_batch_size)


class ForwardBackwardFunc(Protocol):
    """One training (or evaluation) iteration's forwards and backwards over ``spec.num_microbatches`` micro-batches.

    Called by the trainer as ``reports, num_tokens = fn(spec, forward_step_func=..., data_iterator=...,
    model=[chunk, ...], forward_only=False, loss_scale=s, no_sync_func=f, stats=st)``.

    Receives:
        spec: the run's `ScheduleSpec` (shapes, dtype, groups, num_microbatches, max_tokens).
        forward_step_func: ``(data_iterator, chunk) -> (output, loss_func)``; ``output`` is
            ``[s(/tp), b, h]`` on a non-last stage; on the last stage ``loss_func(output) ->
            (loss_sum, num_tokens, report)``: the masked sum of per-token losses (fp32 scalar), the
            number of loss-masked tokens, and a dict the trainer reduces for metrics.
        data_iterator: one iterator, or a list with one per model chunk (interleaved).
        model: the rank's model chunks, one per virtual stage; a chunk (or the module it wraps
            under ``.module``) has ``set_input_tensor(t)`` (use `mptrain.schedules.set_input_tensor`).
        forward_only: evaluation: run the forwards under ``torch.no_grad()``, no backward, leave
            ``stats`` untouched.
        loss_scale: the loss scaler's current scale (1.0 without one).
        no_sync_func: context-manager factory (or list, one per chunk) from the DP wrapper: every
            backward but the last one of each chunk runs under it (`no_sync_context`).
        stats: a `ScheduleStats` or None: note in-flight micro-batches, pass it to p2p for bytes.
    Returns:
        ``(reports, num_tokens)``: one report per micro-batch and an int64 scalar tensor, the sum of
        ``num_tokens`` on the last stage; ``([], 0)`` on other stages.
    Loss normalisation contract (DESIGN.md §3): on the last stage each micro-batch backpropagates
        ``loss_sum · loss_scale / spec.max_tokens`` (what `forward_step` returns), never divided by
        the number of micro-batches; the trainer's finalize_model_grads rescales by
        ``max_tokens / DP-reduced num_tokens``. A schedule changes only the order of the work.
    Helpers it may use (`mptrain.schedules`): `forward_step`, `backward_step`, `no_sync_context`,
        `new_step_state`, `InflightCounter`, `set_input_tensor`, and `p2p` (``P2PConfig(groups=spec.groups,
        tensor_shape=spec.tensor_shape, dtype=spec.dtype, stats=stats)``, ``recv_forward``,
        ``send_forward``, ``recv_backward``, ``send_backward``, ``send_forward_recv_backward``,
        ``send_backward_recv_forward``, and the interleaved combinations). Every rank must make the
        same checks before its first communication, so an error never leaves a peer waiting.

    Optional attribute ``check_layout(layout: PipelineLayout) -> Optional[ForwardBackwardFunc]``:
        called once at start-up (pure, every rank, before any collective). Raise `ConfigError`
        (naming the keys, e.g. ``virtual_pipeline_model_parallel_size``) if the schedule cannot run
        the layout; return None to run as configured, or another schedule to run instead (``auto``
        returns the built-in for the layout; gpipe / 1f1b return no_pipelining on one stage).
    """

    def __call__(self, spec: ScheduleSpec, *, forward_step_func: Callable, data_iterator: Any, model: Sequence,
                 forward_only: bool = False, loss_scale: float = 1.0, no_sync_func: Any = None,
                 stats: Any = None) -> tuple[list, torch.Tensor]: ...


# The per-call keywords the trainer passes (the spec is the first, positional argument).
CALL_KEYWORDS = ("forward_step_func", "data_iterator", "model", "forward_only", "loss_scale", "no_sync_func", "stats")

SCHEDULE_KIND = ComponentKind(
    name="pipeline schedule",
    methods=(),  # a function: its signature is checked instead (`check_signature`)
    runtime_keywords=("spec",) + CALL_KEYWORDS,
    interface=ForwardBackwardFunc,
)


def check_signature(key: str, target_path: str, fn: Any) -> None:
    """A schedule target must be callable as ``fn(spec, forward_step_func=..., ..., stats=...)``.

    Raises:
        ConfigError: not callable, or a per-call keyword it does not accept (naming ``<key>._target_``).
    """
    where = f"{ForwardBackwardFunc.__module__}.{ForwardBackwardFunc.__qualname__}"
    if not callable(fn):
        raise ConfigError(f"{key}._target_={target_path} is not callable ({type(fn).__name__}); a pipeline schedule is "
                          f"a function fn(spec, *, {', '.join(CALL_KEYWORDS)}) ({where})")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin without a signature: trust it
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [] if takes_any_keyword else [k for k in CALL_KEYWORDS if k not in named]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if missing or not positional:
        lacks = f"it takes no keyword {', '.join(missing)}" if missing else "it takes no positional spec argument"
        raise ConfigError(f"{key}._target_={target_path} is not a pipeline schedule: {lacks}; the signature is "
                          f"fn(spec, *, {', '.join(CALL_KEYWORDS)}) ({where})")


def dotted_path(fn: Any) -> str:
    """``module.qualname`` of a function (what ``_target_`` names)."""
    return f"{fn.__module__}.{fn.__qualname__}"
