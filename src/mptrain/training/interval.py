"""The console line's numbers: means over the iterations since the previous line (Megatron's ``training_log``).

Megatron's ``training_log`` (megatron/training/training.py) adds each non-skipped iteration's losses into
``total_loss_dict`` and, every ``--log-interval`` iterations, prints their sum / the number of non-skipped
iterations; its time per iteration is the interval timer's wall time / the interval's iterations (skipped
ones included), and its throughput comes from that mean time; it counts the interval's skipped and nan
iterations. `Interval` keeps those sums for rank 0's console line (`mptrain.training.metrics`), from the
metrics.jsonl rows as they are written: the values there are already on the host, so the means cost no
device read. metrics.jsonl itself keeps one row per iteration (DESIGN.md §2).

Where mptrain differs: the line's grad norm is the mean over the interval's non-skipped iterations too
(Megatron prints the last iteration's); an interval's time excludes evaluations and checkpoint saves, as
Megatron's interval timer stops around them (each row's time ends at the flush before them:
`mptrain.training.metrics.TrainRows`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class IntervalMeans:
    """One console line's interval: the iterations since the previous line, this one's included.

    Attributes:
        iterations: iterations in the interval, skipped ones included.
        skipped: skipped iterations in it (non-finite grads: no update).
        nan: of those, the ones counted in ``nan_iters_total`` (not explained by a dynamic loss scaler).
        lm_loss: mean lm_loss over the non-skipped iterations; None when every one was skipped.
        grad_norm: mean grad norm over the non-skipped iterations; None when every one was skipped.
        time_per_iteration_s: the interval's wall time / ``iterations`` (seconds); None when a time is unknown.
        tokens_per_s, tflops_per_gpu, mfu: the rates of one iteration of ``time_per_iteration_s`` (tokens/s
            over the world, TFLOP/s per GPU, fraction of the peak); None where unknown (mfu: on CPU).
    """

    iterations: int
    skipped: int
    nan: int
    lm_loss: Optional[float]
    grad_norm: Optional[float]
    time_per_iteration_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    mfu: Optional[float] = None


class Interval:
    """Sums of the train rows since the last console line (`add` per row, `close` at a line).

    Args:
        nan_iters_total: the optimizer's ``nan_iters_total`` before the first row (a resumed run's count),
            against which the first interval's nan iterations are counted.
        rates: ``rates(elapsed_s, global_batch_size) -> Throughput`` of one iteration of that many samples
            (None: train.global_batch_size) taking ``elapsed_s`` seconds
            (`mptrain.training.throughput.throughput` with the run's FLOPs and tokens); None = no rates.
    """

    def __init__(self, *, nan_iters_total: int = 0, rates: Optional[Callable[[float], Any]] = None) -> None:
        self.rates = rates
        self._nan_before = nan_iters_total
        self._start()

    def _start(self) -> None:
        self.iterations = self.skipped = self.advanced = self.grad_norms = 0
        self.loss_sum = self.grad_norm_sum = self.time_s = 0.0
        self.batch_sum, self.batches_known = 0, True  # the rows' global batch (a ramp or a step schedule varies it)
        self.timed = True

    def add(self, row: Any, step_time_s: Optional[float]) -> None:
        """One iteration's `mptrain.training.metrics.TrainRow` and its wall time (seconds; None: unknown)."""
        self.iterations += 1
        if row.skipped_iter:  # Megatron: a skipped iteration's loss is not added, its time is
            self.skipped += 1
        else:
            self.advanced += 1
            self.loss_sum += float("nan") if row.lm_loss is None else row.lm_loss
            if row.grad_norm is not None:
                self.grad_norms += 1
                self.grad_norm_sum += row.grad_norm
        batch = getattr(row, "global_batch_size", None)
        if batch is None:
            self.batches_known = False
        else:
            self.batch_sum += batch
        if step_time_s is None:
            self.timed = False
        else:
            self.time_s += step_time_s
        self._nan_total = row.nan_iters_total

    def close(self) -> IntervalMeans:
        """The means of the rows added since the last `close` (at least one), and a fresh interval.

        Raises:
            ValueError: no row was added.
        """
        if self.iterations == 0:
            raise ValueError("Interval.close: no iteration since the last line")
        per_iteration_s = self.time_s / self.iterations if self.timed else None
        # the interval's mean batch: a ramp's or a step schedule's iterations differ from train.global_batch_size
        mean_batch = self.batch_sum / self.iterations if self.batches_known else None
        rates = self.rates(per_iteration_s, mean_batch) if self.rates is not None and per_iteration_s else None
        means = IntervalMeans(
            iterations=self.iterations,
            skipped=self.skipped,
            nan=self._nan_total - self._nan_before,
            lm_loss=self.loss_sum / self.advanced if self.advanced else None,
            grad_norm=self.grad_norm_sum / self.grad_norms if self.grad_norms else None,
            time_per_iteration_s=per_iteration_s,
            tokens_per_s=None if rates is None else rates.tokens_per_s,
            tflops_per_gpu=None if rates is None else rates.tflops_per_gpu,
            mfu=None if rates is None else rates.mfu,
        )
        self._nan_before = self._nan_total
        self._start()
        return means
