"""One training iteration and one evaluation pass (Megatron's train_step / evaluate).

A training iteration (DESIGN.md §3, loss normalisation in docs/ARCHITECTURE.md), of the global batch
`mptrain.config.batch_size.BatchSizeSchedule` gives for the samples consumed before it (constant, or
Megatron's batch-size ramp-up or step schedule):
    zero grads → forward_backward_func over num_microbatches (loss_sum·loss_scale/max_tokens
    backpropagated per micro-batch) → finalize_model_grads (DP sync, SP / tied-embedding grads over
    TP / embedding group) → optimizer.step (unscale × max_tokens / global token count, inf check,
    clip, update or skip) → LR step.
The reported lm_loss is Σ loss_sum / Σ num_tokens over all micro-batches and DP ranks; it lives on
the last pipeline stage and is broadcast over each PP group so that rank 0 logs the real value.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from mptrain.distributed.finalize import token_scale
from mptrain.groups import ParallelGroups
from mptrain.layers.document_mask import DocumentMask
from mptrain.layers.moe import set_aux_loss_scale
from mptrain.precision.module import unwrap
from mptrain.precision.optimizer import StepStats
from mptrain.training.batch import get_batch


def chunk_needs_data(chunk: torch.nn.Module, with_attention_mask: bool) -> bool:
    """First-stage chunks need tokens, last-stage chunks labels; every chunk needs a reset attention mask."""
    inner = unwrap(chunk)
    return inner.pre_process or inner.post_process or with_attention_mask


def make_forward_step(
    groups: ParallelGroups,
    *,
    micro_batch_size: int,
    seq_length: int,
    with_attention_mask: bool,
    device: torch.device,
    timers: Any = None,
    document_offsets: bool = False,
) -> Callable:
    """The forward_step_func of the schedules: (data_iterator, model_chunk) -> (output, loss_func).

    Reading and broadcasting the batch runs under the "batch-generator" timer when `timers` is given.
    With `with_attention_mask` (``data.reset_attention_mask``) the chunk gets the batch's ``[b, 1, s, s]``
    mask, or with `document_offsets` (``data.create_attention_mask_in_dataloader=false``) a
    `mptrain.layers.document_mask.DocumentMask` of its ``cu_seqlens``, one per micro-batch and chunk.
    """
    batch_timer = timers("batch-generator") if timers is not None else contextlib.nullcontext()

    def forward_step(data_iterator: Optional[Iterator], model: torch.nn.Module):
        inner = unwrap(model)
        batch = None
        if chunk_needs_data(model, with_attention_mask):
            with batch_timer:
                batch = get_batch(
                    data_iterator,
                    groups,
                    micro_batch_size=micro_batch_size,
                    seq_length=seq_length,
                    with_attention_mask=with_attention_mask,
                    device=device,
                    document_offsets=document_offsets,
                )
        mask = None if batch is None else batch["attention_mask"]
        if batch is not None and batch["cu_seqlens"] is not None:
            mask = DocumentMask(batch["cu_seqlens"])
        output = model(
            batch["tokens"] if inner.pre_process else None,
            batch["position_ids"] if inner.pre_process else None,
            mask,
            labels=batch["labels"] if inner.post_process else None,
        )

        def loss_func(output_tensor: torch.Tensor):
            # per-token losses [b, s] (fp32); masked sum and count: normalised once, by the schedule/finalize
            mask = batch["loss_mask"]
            loss_sum = (output_tensor.float() * mask).sum()
            num_tokens = mask.sum()
            return loss_sum, num_tokens, {"lm_loss": torch.stack([loss_sum.detach(), num_tokens.detach()])}

        return output, loss_func

    return forward_step


def loss_totals(reports: list, groups: ParallelGroups, device: torch.device) -> torch.Tensor:
    """``[Σ loss_sum, Σ num_tokens]`` (float64, on ``device``) over micro-batches and DP ranks, on every
    rank of the PP group: one DP all-reduce on the last stage and one PP broadcast, no host sync."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    if groups.is_last_stage:
        for report in reports:
            totals += report["lm_loss"].to(torch.float64)
        if groups.dp_size > 1:
            dist.all_reduce(totals, group=groups.dp_group)
    if groups.pp_size > 1:
        dist.broadcast(totals, src=groups.last_pp_rank, group=groups.pp_group)
    return totals


def reduce_loss(reports: list, groups: ParallelGroups, device: torch.device) -> tuple[float, float]:
    """(Σ loss_sum, Σ num_tokens) of `loss_totals`, read on the host (a host sync)."""
    loss_sum, tokens = loss_totals(reports, groups, device).tolist()
    return loss_sum, tokens


class StepRead:
    """The trainer's buffer for one iteration's host read: ``[Σ loss_sum, Σ num_tokens, *StepStats.values]``
    (float64), copied to the host in one device-to-host copy (on CUDA into pinned memory, behind the
    work enqueued so far, without waiting for it); `values` waits for that copy only.
    """

    def __init__(self, totals: torch.Tensor, stats: StepStats) -> None:
        buffer = torch.cat([totals.reshape(-1).to(torch.float64), stats.values.to(totals.device, torch.float64)])
        self._ready = None
        if buffer.device.type == "cuda":
            host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
            host.copy_(buffer, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
            buffer = host
        self._host = buffer

    def values(self) -> list:
        """The buffer's floats (a host sync the first time unless the copy has landed)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


@dataclasses.dataclass
class IterationOutcome:
    """One launched training iteration; its metrics (`Trainer.train_step`'s dict) once settled.

    With a deferred step read (``train.defer_step_read``) the iteration's update is enqueued and its
    statistics are read by the next `Trainer.train_step`, after that one's forward-backward is
    enqueued; `metrics` settles it earlier (a host sync) when the caller needs it now (evaluation,
    a save, the last iteration, an exit).
    """

    trainer: "Trainer"
    global_batch_size: int  # this iteration's samples over all DP ranks (`BatchSizeSchedule.at`)
    num_microbatches: int  # micro-batches per DP rank: global_batch_size / (micro_batch_size × dp)
    _metrics: Optional[dict] = None

    @property
    def is_settled(self) -> bool:
        return self._metrics is not None

    def metrics(self) -> dict:
        """{"lm_loss", "lr", "grad_norm" (None when skipped), "skipped_iter", and the optimizer's
        "loss_scale", "skipped_iters_total", "nan_iters_total" after this iteration; "global_batch_size",
        "num_microbatches" of the iteration}.

        Raises:
            TooManySkippedStepsError: settling this iteration exceeded the skip limit.
        """
        if self._metrics is None:
            self.trainer.settle()
        assert self._metrics is not None, "an IterationOutcome settles in order, by its own trainer"
        return self._metrics


@dataclasses.dataclass
class _Launched:
    """What settling a launched iteration needs (`Trainer.settle`)."""

    outcome: IterationOutcome
    stats: StepStats
    lr: float
    read: StepRead  # loss totals and the step's statistics, on their way to the host


@dataclasses.dataclass
class Trainer:
    """What a step needs; built once by `run` (no hidden state elsewhere)."""

    groups: ParallelGroups
    chunks: list  # DDP-wrapped model chunks (one per virtual stage)
    optimizer: Any
    lr_scheduler: Any
    forward_backward_func: Callable  # the built schedule (`mptrain.schedules.ForwardBackwardFunc`)
    schedule_spec: Any  # its `mptrain.schedules.ScheduleSpec` at the full global batch (evaluation runs it as is)
    forward_step: Callable
    finalize_model_grads: Callable
    device: torch.device
    timers: Any  # mptrain.training.timers.Timers
    batch_sizes: Any  # `mptrain.config.batch_size.BatchSizeSchedule`: each iteration's global batch
    stats: Any = None
    defer_step_read: bool = False
    fp8_weight_casts: Any = None  # precision=fp8: `mptrain.layers.fp8.Fp8WeightCasts`, made current per schedule call
    routing_stats: Any = None  # MoE models: `mptrain.layers.moe.RoutingStats` (read with the loss), else None

    def _weights_settled(self):
        """The context of a schedule call, in which the weights do not change: the FP8 weight casts are made
        once and used by every micro-batch (nothing without FP8 weight casts)."""
        if not self.fp8_weight_casts:
            return contextlib.nullcontext()
        self.finish_param_sync()  # the casts read every weight before the forward's pre-hooks would wait
        return self.fp8_weight_casts.cached()

    def finish_param_sync(self) -> None:
        """Every param all-gather left pending by the last optimizer step (``parallel.overlap_param_gather``)
        lands in the params: before anything reads them outside a training forward (evaluation, a checkpoint
        save, the FP8 weight casts, the end of training)."""
        for chunk in self.chunks:
            chunk.finish_param_sync()

    def __post_init__(self) -> None:
        self._launched: Optional[_Launched] = None

    def spec_at(self, consumed_samples: int):
        """The `ScheduleSpec` of the iteration that begins after ``consumed_samples``: its global batch G from
        `batch_sizes` (Megatron's ``update_num_microbatches(consumed_samples)``), G / (b × dp) micro-batches and
        ``max_tokens`` = G × seq_length, the constant its per-micro-batch backward divides by."""
        spec = self.schedule_spec
        if not self.batch_sizes.varies:
            return spec
        microbatches = self.batch_sizes.num_microbatches(consumed_samples, micro_batch_size=spec.micro_batch_size,
                                                         data_parallel_size=self.groups.dp_size)
        return dataclasses.replace(spec, num_microbatches=microbatches,
                                   max_tokens=self.batch_sizes.at(consumed_samples) * spec.seq_length)

    @property
    def dtype(self) -> torch.dtype:
        return self.schedule_spec.dtype

    def _schedule(self, spec, data_iterators: list, forward_only: bool, **call) -> tuple:
        """One schedule call: ``spec`` (the run's, or an iteration's of a varying batch) plus this call's arguments."""
        return self.forward_backward_func(
            spec,
            forward_step_func=self.forward_step,
            data_iterator=data_iterators if len(self.chunks) > 1 else data_iterators[0],
            model=self.chunks,
            forward_only=forward_only,
            stats=self.stats,
            **call,
        )

    def train_step(self, data_iterators: list, *, consumed_samples: int) -> IterationOutcome:
        """Launch one iteration, the one that begins after ``consumed_samples`` (its global batch: `spec_at`);
        the previous one is settled (its statistics read, the LR schedule moved) after this one's
        forward-backward is enqueued and before its optimizer step.

        Returns:
            this iteration's `IterationOutcome`: settled already unless ``defer_step_read``.
        """
        spec = self.spec_at(consumed_samples)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_scale = self.optimizer.get_loss_scale()
        if self.routing_stats is not None:  # the MoE aux losses' backward scale (its derivation: layers/moe/aux_loss.py)
            for chunk in self.chunks:
                set_aux_loss_scale(chunk, float(loss_scale) / (spec.num_microbatches * self.groups.dp_size))
        with self.timers("forward-backward"), self._weights_settled():
            reports, num_tokens = self._schedule(spec, data_iterators, forward_only=False, loss_scale=loss_scale,
                                                 no_sync_func=self._no_sync_func())
        with self.timers("grads-all-reduce"):  # DP sync, SP / tied-embedding grads, token normalisation
            total = self.finalize_model_grads(self.chunks, self.groups, num_tokens=num_tokens,
                                              max_tokens=spec.max_tokens, scale_grads=False)
        self.settle()  # the previous iteration: by now its statistics are on the host, or nearly
        lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses (the scheduler moves it after)
        # the logged loss, read with the step's statistics (grad norm, skip) in one host read per iteration
        totals = loss_totals(reports, self.groups, self.device)
        if self.routing_stats is not None:  # one all-reduce; read with the loss below
            totals = torch.cat([totals, self.routing_stats.reduce(self.chunks, self.device).to(totals.dtype)])
        # the token normalisation rides in the optimizer's unscale pass (finalize left it out)
        grad_scale = None if total is None else token_scale(total, spec.max_tokens)
        with self.timers("optimizer"):
            stats = self.optimizer.step(grad_scale=grad_scale)
        outcome = IterationOutcome(self, global_batch_size=self.batch_sizes.at(consumed_samples),
                                   num_microbatches=spec.num_microbatches)
        self._launched = _Launched(outcome, stats, lr, StepRead(totals, stats))
        if not self.defer_step_read:
            self.settle()
        return outcome

    def settle(self) -> None:
        """Read the launched iteration's statistics (a host sync unless they arrived), move the LR
        schedule after a successful update, and fill its outcome's metrics; nothing when none is launched.

        Raises:
            TooManySkippedStepsError: from the optimizer's skip limit (the iteration stays unsettled).
        """
        launched, self._launched = self._launched, None
        if launched is None:
            return
        loss_sum, tokens, *values = launched.read.values()  # host sync: the iteration's one read
        moe = self.routing_stats.size if self.routing_stats is not None else 0
        routing, step_values = values[:moe], values[moe:]
        result = launched.stats.settle(step_values)
        if result.update_successful:  # Megatron: a skipped iteration counts, but the LR schedule waits
            # a varying batch: the schedule counts each applied step's samples (Megatron's increment), else steps
            self.lr_scheduler.step(launched.outcome.global_batch_size if self.batch_sizes.varies else 1)
        launched.outcome._metrics = {
            "lm_loss": loss_sum / max(tokens, 1.0),
            "lr": launched.lr,
            "grad_norm": result.grad_norm if result.update_successful else None,
            "skipped_iter": not result.update_successful,
            "loss_scale": self.optimizer.get_loss_scale(),  # as of this iteration: settled before the next step
            "skipped_iters_total": result.skipped_iters_total,
            "nan_iters_total": result.nan_iters_total,
            "global_batch_size": launched.outcome.global_batch_size,
            "num_microbatches": launched.outcome.num_microbatches,
        }
        if self.routing_stats is not None:
            launched.outcome._metrics["moe"] = self.routing_stats.summary(
                routing, launched.outcome.num_microbatches * self.groups.dp_size)

    def _no_sync_func(self):
        if len(self.chunks) == 1:
            return self.chunks[0].no_sync
        from contextlib import ExitStack

        def no_sync_all():
            stack = ExitStack()
            for chunk in self.chunks:
                stack.enter_context(chunk.no_sync())
            return stack

        return no_sync_all

    @torch.no_grad()
    def evaluate(self, make_iterators: Callable[[], list], eval_iters: int) -> float:
        """Mean loss over `eval_iters` global batches (forward only); known on every rank."""
        self.finish_param_sync()  # Megatron's disable_forward_pre_hook before evaluation
        for chunk in self.chunks:
            chunk.eval()
        iterators = make_iterators()
        total_loss, total_tokens = 0.0, 0.0
        with self._weights_settled():
            for _ in range(eval_iters):
                # Megatron evaluates at eval_global_batch_size (its global batch size), whatever the training batch
                reports, _ = self._schedule(self.schedule_spec, iterators, forward_only=True)
                loss_sum, tokens = reduce_loss(reports, self.groups, self.device)
                total_loss, total_tokens = total_loss + loss_sum, total_tokens + tokens
        for chunk in self.chunks:
            chunk.train()
        return total_loss / max(total_tokens, 1.0)
