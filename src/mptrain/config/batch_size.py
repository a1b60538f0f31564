"""The global batch size of each iteration: ``train.global_batch_size``, Megatron's batch-size ramp-up
(``train.rampup_batch_size``) or its step schedule (``train.step_batch_size_schedule``), and the rules and
iteration count that follow from them.

Ramp-up: Megatron-LM's ``--rampup-batch-size <start> <increment> <ramp_samples>``
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

Step schedule: Megatron-LM's ``--step-batch-size-schedule "THRESHOLD:BATCH ..."``
(``StepBatchsizeNumMicroBatchesCalculator``, same file), e.g. its GPT-3 175B example's
``"0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"``. Entries are separated by spaces or commas; each
number may end in K, M, B or T (10^3 ... 10^12; ``int(float(value) × multiplier)``, as Megatron). A
threshold counts tokens (Megatron passes ``--seq-length`` to the calculator in training) and becomes
``tokens // seq_length`` samples; the entries are sorted by it. Then

    G(c) = the batch of the last entry whose threshold (in samples) is <= c

and each DP rank runs G(c) / (micro_batch_size × dp) micro-batches, as above. Rules (Megatron's
``_validate_schedule``): at least one entry, the first threshold 0 samples, thresholds strictly increasing
in samples, batches > 0; each batch the run reaches a multiple of micro_batch_size × dp (its
``consistency_check``) that never decreases from one iteration to the next (its training loop's assert).
Iteration- and sample-based training both work. With train_samples the count is Megatron's
``update_train_iters`` for the schedule: iterations run while the consumed samples are below
train_samples, so the last one is trained whole (nothing is dropped). Example, seq_length 64,
``"0:2 256:4 1K:8"`` (thresholds 0, 4 and 15 samples), train_samples 30: batches 2, 2, 4, 4, 4, 8, 8
(consumed before: 0, 2, 4, 8, 12, 16, 24), 7 iterations, 32 samples.

`train.global_batch_size` beside a step schedule keeps the roles Megatron's ``args.global_batch_size`` has
there: the evaluation's global batch (``--eval-global-batch-size``'s default) and the samples of one
iteration where an LR length counts iterations (`mptrain.optim.lr_scheduler`). Megatron rejects
``--global-batch-size`` beside the schedule and takes micro_batch_size × dp for both; mptrain cannot tell
a default from a given value and takes train.global_batch_size as it is (micro_batch_size × dp gives
Megatron's numbers). A ramp and a step schedule together are an error (Megatron ignores the deprecated ramp).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

from mptrain.errors import ConfigError

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
"""Megatron's ``_parse_numeric_value`` multipliers (case-insensitive)."""


@dataclasses.dataclass(frozen=True)
class BatchPhase:
    """Consecutive iterations at one global batch size.

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


def _number(text: str) -> int:
    """Megatron's ``_parse_numeric_value``: ``2.4B`` -> int(float("2.4") × 10^9). Raises ValueError / OverflowError."""
    text = text.strip().upper()
    multiplier = SUFFIXES.get(text[-1:], 1)
    if multiplier != 1:
        text = text[:-1]
    return int(float(text) * multiplier)


def parse_step_batch_size_schedule(text: str, seq_length: int) -> tuple:
    """``train.step_batch_size_schedule`` as ((threshold in samples, global batch), ...) sorted by threshold:
    Megatron's ``_parse_schedule`` (thresholds in tokens, // seq_length) and ``_validate_schedule``.

    Raises:
        ConfigError: an entry that is not THRESHOLD:BATCH with numbers Megatron reads; no entry; the smallest
            threshold not 0 samples; two thresholds in one sample (or equal); a batch < 1.
    """
    shown = f'train.step_batch_size_schedule="{text}"'
    if seq_length < 1:
        raise ConfigError(f"{shown} counts tokens, which model.seq_length={seq_length} turns into samples; set "
                          "model.seq_length >= 1")
    entries = []  # (threshold in samples, batch, the entry as written)
    for entry in str(text).strip().replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        try:
            if not colon:
                raise ValueError(entry)
            entries.append((_number(threshold) // seq_length, _number(batch), entry))
        except (ValueError, OverflowError):
            raise ConfigError(f"{shown}: {entry!r} is not THRESHOLD:BATCH_SIZE (numbers with an optional K, M, B or T "
                              "suffix, e.g. 2.4B:320; entries separated by spaces or commas)") from None
    if not entries:
        raise ConfigError(f"{shown} has no entry; give THRESHOLD:BATCH_SIZE pairs, e.g. \"0:16 2.4B:320\" (thresholds "
                          "in tokens), or set train.step_batch_size_schedule=null for a constant global batch size")
    entries.sort(key=lambda e: e[0])  # Megatron sorts by threshold (stable)
    if entries[0][0] != 0:
        raise ConfigError(f"{shown}: the first threshold must be 0 samples (the batch of the first iteration), got "
                          f"{entries[0][2]!r} = {entries[0][0]} samples of model.seq_length={seq_length} tokens; add "
                          f"an entry 0:<batch>")
    for (before, _, a), (after, _, b) in zip(entries, entries[1:]):
        if after <= before:
            raise ConfigError(f"{shown}: thresholds must be strictly increasing in samples (tokens // "
                              f"model.seq_length={seq_length}), but {a!r} and {b!r} are both sample {after}; "
                              f"drop one or move it at least {seq_length} tokens away")
    for _, batch, entry in entries:
        if batch < 1:
            raise ConfigError(f"{shown}: {entry!r} gives a global batch size of {batch}; each must be >= 1")
    return tuple((threshold, batch) for threshold, batch, _ in entries)


@dataclasses.dataclass(frozen=True)
class BatchSizeSchedule:
    """The global batch size of every iteration, asked by consumed samples (the one place that knows it).

    Args:
        global_batch_size: ``train.global_batch_size``: the batch after the ramp, or throughout; beside a step
            schedule the evaluation's batch and an LR iteration's samples (module docstring).
        rampup_batch_size: ``train.rampup_batch_size`` as (start, increment, ramp_samples), or None.
        step_batch_size_schedule: `parse_step_batch_size_schedule`'s ((threshold samples, batch), ...), or None.
    """

    global_batch_size: int
    rampup_batch_size: Optional[tuple] = None
    step_batch_size_schedule: Optional[tuple] = None

    @classmethod
    def of(cls, train, *, seq_length: Optional[int] = None) -> "BatchSizeSchedule":
        """From the ``train`` config node and ``model.seq_length`` (needed with a step schedule), checked by
        `check_rampup_batch_size` and `check_step_batch_size_schedule` first."""
        ramp, steps = train.rampup_batch_size, train.step_batch_size_schedule
        assert steps is None or seq_length is not None, "a step schedule's token thresholds need model.seq_length"
        return cls(int(train.global_batch_size), None if ramp is None else tuple(int(v) for v in ramp),
                   None if steps is None else parse_step_batch_size_schedule(steps, seq_length))

    @property
    def varies(self) -> bool:
        """A ramp or a step schedule: the iterations' global batch follows the consumed samples."""
        return self.rampup_batch_size is not None or self.step_batch_size_schedule is not None

    def at(self, consumed_samples: int) -> int:
        """G(c): the global batch of the iteration that begins after ``consumed_samples`` (module docstring)."""
        if self.step_batch_size_schedule is not None:
            return self.step_batch_size_schedule[self._entry(consumed_samples)][1]
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, ramp_samples = self.rampup_batch_size
        if consumed_samples > ramp_samples:
            return self.global_batch_size
        # Megatron: steps = int(consumed_samples / rampup_samples_per_increment), a float quotient
        samples_per_increment = ramp_samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed_samples / samples_per_increment) * increment

    def _entry(self, consumed_samples: int) -> int:
        """The step schedule's entry in force after ``consumed_samples``: the last with threshold <= c (the first
        threshold is 0)."""
        thresholds = [threshold for threshold, _ in self.step_batch_size_schedule]
        return bisect.bisect_right(thresholds, consumed_samples) - 1

    def _iterations_at_entry(self, consumed_samples: int, limit: Optional[int] = None) -> Optional[int]:
        """Iterations from ``consumed_samples`` at the step schedule's entry in force there: those beginning below
        the next threshold and below ``limit``; None when neither bounds them (the last entry, no limit)."""
        entries, following = self.step_batch_size_schedule, self._entry(consumed_samples) + 1
        bounds = [] if limit is None else [limit]
        if following < len(entries):
            bounds.append(entries[following][0])
        if not bounds:
            return None
        return -(-(min(bounds) - consumed_samples) // self.at(consumed_samples))  # ceil: each that begins below

    def num_microbatches(self, consumed_samples: int, *, micro_batch_size: int, data_parallel_size: int) -> int:
        """Micro-batches per DP rank of that iteration: G(c) / (micro_batch_size × dp) (divisible: `check_batch_layout`)."""
        return self.at(consumed_samples) // (micro_batch_size * data_parallel_size)

    def phases(self, train_samples: Optional[int] = None) -> list:
        """The ramp's iterations (those beginning at c <= ramp_samples, and <= ``train_samples`` when given) as
        `BatchPhase` runs of one batch size; [] without a ramp. O(increments × log) evaluations of `at`."""
        if self.rampup_batch_size is None:
            return []
        ramp_samples = self.rampup_batch_size[2]
        limit = ramp_samples if train_samples is None else min(ramp_samples, train_samples)
        phases, consumed, iteration = [], 0, 1
        while consumed <= limit:
            batch = self.at(consumed)
            length = self._phase_length(consumed, batch, limit)
            phases.append(BatchPhase(iteration, consumed, batch, length))
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

    def runs(self, train_iters: int) -> list:
        """Iterations 1..``train_iters`` as `BatchPhase` runs of one global batch (adjacent equal ones merged):
        what the run trains, for its checks and its log line. O(entries) for a step schedule."""
        if self.step_batch_size_schedule is not None:
            runs, consumed, iteration = [], 0, 1
            while iteration <= train_iters:
                batch, left = self.at(consumed), train_iters - iteration + 1
                length = min(self._iterations_at_entry(consumed) or left, left)
                runs.append(BatchPhase(iteration, consumed, batch, length))
                consumed, iteration = consumed + length * batch, iteration + length
        else:
            runs = [p for p in self.phases() if p.first_iteration <= train_iters]
            if runs and runs[-1].last_iteration > train_iters:
                runs[-1] = dataclasses.replace(runs[-1], iterations=train_iters - runs[-1].first_iteration + 1)
            after = runs[-1].last_iteration + 1 if runs else 1
            if train_iters >= after:
                consumed = runs[-1].consumed_samples + runs[-1].iterations * runs[-1].global_batch_size if runs else 0
                runs.append(BatchPhase(after, consumed, self.global_batch_size, train_iters - after + 1))
        return _merged(runs)

    def train_iters(self, train_samples: int) -> int:
        """Iterations that train ``train_samples`` samples: Megatron's ``update_train_iters`` (module docstring)."""
        if self.step_batch_size_schedule is not None:
            consumed, iterations = 0, 0
            while consumed < train_samples:  # Megatron: the last iteration is trained whole
                length = self._iterations_at_entry(consumed, train_samples)
                consumed, iterations = consumed + length * self.at(consumed), iterations + length
            return iterations
        phases = self.phases(train_samples)
        if not phases:
            return train_samples // self.global_batch_size
        last = phases[-1]
        consumed = last.consumed_samples + last.iterations * last.global_batch_size
        # Megatron: "we throw away any partial last batch"
        rest = (train_samples - consumed) // self.global_batch_size if train_samples > consumed else 0
        return last.last_iteration + rest

    def run_iterations(self, train) -> int:
        """The run's last iteration: ``train.train_iters``, or the count `train_iters` gives ``train.train_samples``."""
        return train.train_iters if train.train_samples is None else self.train_iters(train.train_samples)


def _merged(runs: list) -> list:
    """``runs`` with adjacent runs of one global batch joined."""
    out: list = []
    for run in runs:
        if out and out[-1].global_batch_size == run.global_batch_size:
            out[-1] = dataclasses.replace(out[-1], iterations=out[-1].iterations + run.iterations)
        else:
            out.append(run)
    return out


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


def check_step_batch_size_schedule(train, seq_length: int) -> None:
    """``train.step_batch_size_schedule``'s own rules (`parse_step_batch_size_schedule`), before any layout is known.

    Raises:
        ConfigError: set together with train.rampup_batch_size; the parse rules.
    """
    steps = train.step_batch_size_schedule
    if steps is None:
        return
    if train.rampup_batch_size is not None:
        # Megatron ignores its deprecated ramp-up beside a schedule; here one of them is asked for
        raise ConfigError(f'train.step_batch_size_schedule="{steps}" and train.rampup_batch_size='
                          f"{list(train.rampup_batch_size)} both set the global batch of each iteration; set one of "
                          "them to null")
    parse_step_batch_size_schedule(steps, seq_length)


def varying_batch_key(train) -> Optional[str]:
    """The key that varies the global batch, as messages show it (``train.rampup_batch_size=[2, 2, 12]``,
    ``train.step_batch_size_schedule="0:2 256:4"``); None for a constant batch."""
    if train.step_batch_size_schedule is not None:
        return f'train.step_batch_size_schedule="{train.step_batch_size_schedule}"'
    if train.rampup_batch_size is not None:
        return f"train.rampup_batch_size={list(train.rampup_batch_size)}"
    return None


def check_batch_layout(train, micro_batch_size: int, data_parallel_size: int, *, seq_length: int) -> list:
    """Every global batch size a ramp or a step schedule reaches in the run is a multiple of micro_batch_size × dp
    (Megatron's ``consistency_check``, there at the iteration that reaches it, here before any collective), and a
    step schedule's never decreases (Megatron's training loop asserts it of the micro-batch count). Returns the
    run's `BatchPhase` runs (`BatchSizeSchedule.runs`; [] for a constant batch).

    Raises:
        ConfigError: the first batch size that is not, with its iterations.
    """
    key = varying_batch_key(train)
    if key is None:
        return []
    schedule = BatchSizeSchedule.of(train, seq_length=seq_length)
    runs = schedule.runs(schedule.run_iterations(train))
    step = micro_batch_size * data_parallel_size
    fix = ("make start and increment multiples of" if train.rampup_batch_size is not None
           else "make each batch size of the schedule a multiple of")
    for before, run in zip([None] + runs, runs):
        if run.global_batch_size % step:
            raise ConfigError(
                f"{key} reaches a global batch size of {run.global_batch_size} ({run.span}), which is not divisible by "
                f"train.micro_batch_size × data-parallel size = {micro_batch_size} × {data_parallel_size} = {step}; "
                f"{fix} {step}")
        if before is not None and run.global_batch_size < before.global_batch_size:
            raise ConfigError(
                f"{key} goes down from a global batch size of {before.global_batch_size} ({before.span}) to "
                f"{run.global_batch_size} ({run.span}); the number of micro-batches must not decrease (Megatron's "
                "training loop asserts it): make the batch sizes non-decreasing in their thresholds")
    return runs
