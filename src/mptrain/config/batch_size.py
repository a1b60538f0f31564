"""The global batch size of each iteration: ``train.global_batch_size``, or Megatron's batch-size ramp-up
(``train.rampup_batch_size``), and the rules and iteration count that follow from it.

Megatron-LM's ``--rampup-batch-size <start> <increment> <ramp_samples>``
(megatron/core/num_microbatches_calculator.py, ``RampupBatchsizeNumMicroBatchesCalculator``; Megatron
later replaced it by ``--step-batch-size-schedule``). With n = (global_batch_size - start) / increment
increments spread evenly over ramp_samples samples, the iteration that begins after c consumed samples
has the global batch

    G(c) = global_batch_size                                 if c > ramp_samples
           start + int(c / (ramp_samples / n)) × increment    otherwise (float division, as Megatron)

Consumed samples advance by G(c) every iteration, skipped ones included; each DP rank runs
G(c) / (micro_batch_size × dp) micro-batches of it (Megatron's ``get_num_microbatches`` after
``update_num_microbatches(consumed_samples)``). The samples an iteration reads are [c, c + G(c)) of
the one sample order, whatever the layout (`mptrain.data.sampler`).

Ramp-up needs training by samples (Megatron's arguments.py: "expected no batch-size rampup for
iteration-based training"). The iteration count is Megatron's ``update_train_iters``: every
iteration that begins at c <= min(ramp_samples, train_samples) runs (so where train_samples ends
inside the ramp, the batch that crosses it is trained whole), then (train_samples - c) //
global_batch_size more at the full batch (a last partial batch is dropped).

Example, global_batch_size 8, ramp [2, 2, 32] (n = 3 increments of 2, one every 32 / 3 = 10.67
samples), train_samples 64:

    iterations   consumed before   global batch
    1-6          0, 2, ..., 10     2
    7-9          12, 16, 20        4
    10-11        24, 30            6
    12-14        36, 44, 52        8     (c = 36 > 32: the ramp is over)

14 iterations (`BatchSizeSchedule.train_iters`): the ramp's 11, then (64 - 36) // 8 = 3; the last 4
samples are dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mptrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RampPhase:
    """Consecutive iterations of the ramp at one global batch size.

    Attributes:
        first_iteration: the first of them, counted from 1.
        consumed_samples: samples consumed before it.
        global_batch_size: the batch of each.
        iterations: how many.
    """

    first_iteration: int
    consumed_samples: int
    global_batch_size: int
    iterations: int

    @property
    def last_iteration(self) -> int:
        return self.first_iteration + self.iterations - 1

    @property
    def span(self) -> str:
        """``iteration 7`` or ``iterations 7-9``, for messages."""
        if self.iterations == 1:
            return f"iteration {self.first_iteration}"
        return f"iterations {self.first_iteration}-{self.last_iteration}"


@dataclasses.dataclass(frozen=True)
class BatchSizeSchedule:
    """The global batch size of every iteration, asked by consumed samples (the one place that knows it).

    Args:
        global_batch_size: ``train.global_batch_size``, the batch after the ramp (or throughout).
        rampup_batch_size: ``train.rampup_batch_size`` as (start, increment, ramp_samples), or None (constant).
    """

    global_batch_size: int
    rampup_batch_size: Optional[tuple] = None

    @classmethod
    def of(cls, train) -> "BatchSizeSchedule":
        """From the ``train`` config node (checked by `check_rampup_batch_size` first)."""
        ramp = train.rampup_batch_size
        return cls(int(train.global_batch_size), None if ramp is None else tuple(int(v) for v in ramp))

    @property
    def ramps(self) -> bool:
        return self.rampup_batch_size is not None

    def at(self, consumed_samples: int) -> int:
        """G(c): the global batch of the iteration that begins after ``consumed_samples`` (module docstring)."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        if consumed_samples > ramp_samples:
            return self.global_batch_size
        # Megatron: steps = int(consumed_samples / rampup_samples_per_increment), a float quotient
        samples_per_increment = ramp_samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed_samples / samples_per_increment) * increment

    def num_microbatches(self, consumed_samples: int, *, micro_batch_size: int, data_parallel_size: int) -> int:
        """Micro-batches per DP rank of that iteration: G(c) / (micro_batch_size × dp) (divisible: `check_ramp_layout`)."""
        return self.at(consumed_samples) // (micro_batch_size * data_parallel_size)

    def phases(self, train_samples: Optional[int] = None) -> list:
        """The ramp's iterations (those beginning at c <= ramp_samples, and <= ``train_samples`` when given) as
        `RampPhase` runs of one batch size; [] without a ramp. O(increments × log) evaluations of `at`."""
        if self.rampup_batch_size is None:
            return []
        ramp_samples = self.rampup_batch_size[2]
        limit = ramp_samples if train_samples is None else min(ramp_samples, train_samples)
        phases, consumed, iteration = [], 0, 1
        while consumed <= limit:
            batch = self.at(consumed)
            length = self._phase_length(consumed, batch, limit)
            phases.append(RampPhase(iteration, consumed, batch, length))
            consumed, iteration = consumed + length * batch, iteration + length
        return phases

    def _phase_length(self, consumed: int, batch: int, limit: int) -> int:
        """Iterations from ``consumed`` at ``batch`` while G stays ``batch`` and each begins at <= ``limit``:
        the smallest j >= 1 with c + j·batch > limit or G(c + j·batch) != batch (G never decreases: bisection)."""
        lo, hi = 1, (limit - consumed) // batch + 1  # hi: the first j beyond the limit
        while lo < hi:
            mid = (lo + hi) // 2
            if self.at(consumed + mid * batch) != batch:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def train_iters(self, train_samples: int) -> int:
        """Iterations that train ``train_samples`` samples: Megatron's ``update_train_iters`` (module docstring)."""
        phases = self.phases(train_samples)
        if not phases:
            return train_samples // self.global_batch_size
        last = phases[-1]
        consumed = last.consumed_samples + last.iterations * last.global_batch_size
        # Megatron: "we throw away any partial last batch"
        rest = (train_samples - consumed) // self.global_batch_size if train_samples > consumed else 0
        return last.last_iteration + rest


def check_rampup_batch_size(train) -> None:
    """``train.rampup_batch_size``'s own rules (Megatron's asserts), before any layout is known.

    Raises:
        ConfigError: not [start, increment, ramp_samples]; a value < 1 (Megatron asserts start and
            increment > 0, and divides by ramp_samples); start >= global_batch_size (Megatron asserts
            start <= global_batch_size and divides by the zero increments of start = global_batch_size);
            global_batch_size - start not a multiple of increment; training by iterations.
    """
    ramp = train.rampup_batch_size
    if ramp is None:
        return
    shown = f"train.rampup_batch_size={list(ramp)}"
    if len(ramp) != 3:
        raise ConfigError(f"{shown} must be [start, increment, ramp_samples] (Megatron's --rampup-batch-size <start> "
                          "<increment> <ramp-samples>), or null for a constant global batch size")
    start, increment, ramp_samples = (int(v) for v in ramp)
    if min(start, increment, ramp_samples) < 1:
        raise ConfigError(f"{shown}: start, increment and ramp_samples must each be >= 1 (null: no ramp-up)")
    gbs = train.global_batch_size
    if start >= gbs:
        raise ConfigError(f"{shown} starts at {start}, which must be below train.global_batch_size={gbs} (the batch the "
                          f"ramp ends at); lower start, raise train.global_batch_size, or set train.rampup_batch_size=null")
    if (gbs - start) % increment:
        raise ConfigError(
            f"{shown}: train.global_batch_size - start = {gbs} - {start} = {gbs - start} is not a multiple of "
            f"increment={increment}; pick an increment that divides {gbs - start}, or set train.global_batch_size="
            f"{start + (gbs - start) // increment * increment or start + increment}")
    if train.train_samples is None:
        raise ConfigError(f"{shown} needs training by samples (Megatron: no batch-size ramp-up for iteration-based "
                          "training); set train.train_samples=<samples> and train.train_iters=null")


def check_ramp_layout(train, micro_batch_size: int, data_parallel_size: int) -> list:
    """Every global batch size the ramp reaches before ``train.train_samples`` is a multiple of
    micro_batch_size × dp (Megatron's ``consistency_check``, there at the iteration that reaches it,
    here before any collective). Returns the ramp's `RampPhase` list ([] without a ramp).

    Raises:
        ConfigError: the first batch size that is not, with its iterations.
    """
    phases = BatchSizeSchedule.of(train).phases(train.train_samples)
    step = micro_batch_size * data_parallel_size
    for phase in phases:
        if phase.global_batch_size % step:
            raise ConfigError(
                f"train.rampup_batch_size={list(train.rampup_batch_size)} reaches a global batch size of "
                f"{phase.global_batch_size} ({phase.span}), which is not "
                f"divisible by train.micro_batch_size × data-parallel size = {micro_batch_size} × {data_parallel_size} "
                f"= {step}; make start and increment multiples of {step}")
    return phases
