"""metrics.jsonl, train.log and the console line, written by rank 0 only (DESIGN.md §2).

metrics.jsonl gets one `train` row per iteration with exactly the keys of `TrainRow` (the
DESIGN.md §2 list, in that order) and `valid` / `test` rows (`EvalRow`: lm_loss and ppl); each row
is flushed as soon as it is written, so a crash keeps every finished iteration. Non-finite floats
are written as null (strict JSON has no NaN / Infinity); `nan_iters_total` counts them.

`train.log` (same folder) gets the paced console lines, every message, and the records of the
`mptrain` Python logger while the writer is open. The console prints a step line every
`train.log_interval` iterations and on the last one (above the progress bar, which moves every
iteration, when there is one: `Console`). As Megatron's, the step line reports its interval (the
iterations since the previous line): the mean lm_loss and grad norm over the non-skipped ones, the
mean time per iteration and the rates from it, the skipped and nan iterations
(`mptrain.training.interval`); the samples, LR, loss scale and memory are the last iteration's. Every
line of an iteration starts with `iter N/T` (`iteration_prefix`): step lines, evaluation lines, the
timers line.

On a resume, `start_iteration` drops rows after the checkpoint's iteration, so the file holds each
iteration once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import IO, Any, Callable, Optional

from mptrain.training.console import Console
from mptrain.training.interval import Interval, IntervalMeans

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
PPL_MAX_LOSS = 20.0  # Megatron's training.py: ppl = exp(min(20, loss)), keeps ppl finite for a diverged run


@dataclasses.dataclass
class TrainRow:
    """One training iteration (DESIGN.md §2). Units: samples, tokens/s, TFLOP/s per GPU, GiB.

    `iteration` counts completed optimizer steps from 1 (skipped ones included); `grad_norm` is
    None on a skipped step; `mfu` and `mem_allocated_gib` are None on CPU. `global_batch_size` is the
    iteration's (samples over all DP ranks; ``train.rampup_batch_size`` / ``step_batch_size_schedule`` vary it), run as
    `num_microbatches` micro-batches per DP rank; `consumed_samples` counts it in. `moe`: an MoE model's routing
    statistics (`mptrain.layers.moe.stats.STAT_KEYS`), written after the DESIGN.md keys; None (no keys) for a
    dense model.
    """

    iteration: int
    consumed_samples: int
    lm_loss: float
    lr: float
    grad_norm: Optional[float]
    loss_scale: float
    skipped_iter: bool
    skipped_iters_total: int
    nan_iters_total: int
    global_batch_size: int
    num_microbatches: int
    tokens_per_s: float
    tflops_per_gpu: Optional[float]
    mfu: Optional[float]
    mem_allocated_gib: Optional[float]
    moe: Optional[dict] = None

    def as_dict(self) -> dict:
        row = {"split": "train", **{k: getattr(self, k) for k in TRAIN_KEYS[1:]}}
        return {**row, **(self.moe or {})}


TRAIN_KEYS = ("split",) + tuple(f.name for f in dataclasses.fields(TrainRow) if f.name != "moe")
"""The DESIGN.md §2 keys of every train row, in order (an MoE model's `TrainRow.moe` keys follow them)."""


@dataclasses.dataclass
class EvalRow:
    """One evaluation (`split` valid | test); ppl = exp(min(lm_loss, 20)) as Megatron."""

    split: str
    iteration: int
    lm_loss: float

    def as_dict(self) -> dict:
        if self.split not in ("valid", "test"):
            raise ValueError(f"EvalRow.split must be 'valid' or 'test', got {self.split!r}")
        loss = float(self.lm_loss)
        ppl = math.exp(min(loss, PPL_MAX_LOSS)) if math.isfinite(loss) else None
        return {"split": self.split, "iteration": self.iteration, "lm_loss": loss, "ppl": ppl}


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_train_line(row: TrainRow, interval: IntervalMeans, train_iters: Optional[int] = None) -> str:
    """The console / log line of the interval that ends with train row ``row``: the interval's means and
    counts (`IntervalMeans`), the last iteration's samples, LR, loss scale, micro-batches, memory and MoE routing
    statistics."""
    total = f"/{train_iters}" if train_iters is not None else ""
    ms = None if interval.time_per_iteration_s is None else 1000.0 * interval.time_per_iteration_s
    parts = [
        f"iter {row.iteration}{total}",
        f"samples {row.consumed_samples}",
        f"ms/iter {_fmt(ms, '.1f')}",
        f"lm_loss {_fmt(interval.lm_loss, '.6f')}",
        f"lr {_fmt(row.lr, '.3e')}",
        f"grad_norm {_fmt(interval.grad_norm, '.4f')}",
        f"loss_scale {_fmt(row.loss_scale, 'g')}",
        f"skipped {interval.skipped}",
        f"nan {interval.nan}",
        f"batch {row.global_batch_size}",
        f"mb {row.num_microbatches}",
        f"tokens/s {_fmt(interval.tokens_per_s, '.1f')}",
        f"TFLOP/s/GPU {_fmt(interval.tflops_per_gpu, '.2f')}",
        f"MFU {_fmt(interval.mfu, '.3f')}",
    ]
    if row.mem_allocated_gib is not None:
        parts.append(f"mem {row.mem_allocated_gib:.2f} GiB")
    if row.moe is not None and format_moe(row.moe):
        parts.append(format_moe(row.moe))
    return " | ".join(parts)


def format_moe(moe: dict) -> str:
    """The console's MoE part: aux / z loss (when on), the fewest and most tokens an expert of any MoE layer
    took in the iteration, dropped assignments (with a capacity)."""
    most, least = moe["moe_tokens_per_expert_max"], moe["moe_tokens_per_expert_min"]
    parts = [f"moe_aux {moe['moe_aux_loss']:.4f}"] if moe["moe_aux_loss"] is not None else []
    if moe["moe_z_loss"] is not None:
        parts.append(f"moe_z {moe['moe_z_loss']:.4f}")
    if most:
        parts.append(f"expert tokens min/max {min(least)}/{max(most)}")
    if moe["moe_dropped_tokens"] is not None:
        parts.append(f"dropped {moe['moe_dropped_tokens']}")
    return " | ".join(parts)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """All rows of `<run_dir>/metrics.jsonl` (for tests and the sweep summary)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, last_iteration: int) -> None:
    """Drop rows with iteration > last_iteration (rows of iterations redone after a resume)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["iteration"] <= last_iteration]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class MetricsWriter:
    """Rank 0's metrics.jsonl + train.log + console; every method is a no-op on other ranks.

    Args:
        run_dir: the run folder (exists).
        rank: global rank; only rank 0 writes.
        log_interval: console pacing (`train.log_interval`, >= 1): a step line every that many
            iterations and on the last, with the means of its interval.
        train_iters: the last iteration (console total; also always printed).
        start_iteration: iterations already done (0, or the checkpoint's iteration on resume).
        progress_bar: True / False / None (= on interactive terminals), see `Console`.
        stream: console stream (default sys.stdout).
        rates: ``rates(elapsed_s) -> Throughput`` of one iteration (the step line's tokens/s, TFLOP/s/GPU,
            MFU from the interval's mean time); None = those columns read ``-``.
        nan_iters_total: the optimizer's count before the first row (a resumed run's), the base of the
            first interval's nan count.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        rank: int,
        *,
        log_interval: int = 1,
        train_iters: Optional[int] = None,
        start_iteration: int = 0,
        progress_bar: Optional[bool] = None,
        stream: Optional[IO] = None,
        rates: Optional[Callable[[float], Any]] = None,
        nan_iters_total: int = 0,
    ) -> None:
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.active = rank == 0
        self.log_interval = log_interval
        self.train_iters = train_iters
        self.run_dir = Path(run_dir)
        self.interval = Interval(nan_iters_total=nan_iters_total, rates=rates)
        self._metrics = self._log = self.console = None
        self._handler: Optional[logging.Handler] = None
        if not self.active:
            return
        metrics_path = self.run_dir / METRICS_FILE
        if train_iters is not None and 0 < train_iters <= start_iteration:
            pass  # nothing left to train (run.py says so): the rows already written stay as they are
        elif start_iteration > 0:
            truncate_metrics(metrics_path, start_iteration)
        else:
            metrics_path.unlink(missing_ok=True)  # an empty or appended-to run folder starts a fresh table
        self._metrics = open(metrics_path, "a", encoding="utf-8")
        self._log = open(self.run_dir / LOG_FILE, "a", encoding="utf-8")
        self.console = Console(stream, progress_bar=progress_bar, total_iters=train_iters, start_iteration=start_iteration)
        self._attach_logging()

    # --- the mptrain Python logger goes to train.log while the writer is open ------------------
    def _attach_logging(self) -> None:
        logger = logging.getLogger("mptrain")
        self._handler = logging.StreamHandler(self._log)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(self._handler)
        self._old_level = logger.level
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)

    def _write_row(self, row: dict) -> None:
        clean = {k: _finite_or_none(v) for k, v in row.items()}
        try:
            self._metrics.write(json.dumps(clean, allow_nan=False) + "\n")
            self._metrics.flush()
        except OSError as err:
            raise self._storage_error(METRICS_FILE, err, row.get("iteration")) from None

    def _log_line(self, text: str) -> None:
        try:
            self._log.write(text + "\n")
            self._log.flush()
        except OSError as err:
            raise self._storage_error(LOG_FILE, err, None) from None

    def _storage_error(self, name: str, err: OSError, iteration: Optional[int]):
        """One line for a failed write (disk full, unwritable): the file, the cause, the fix."""
        import errno

        from mptrain.errors import StorageError

        cause = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
        at = f" at iteration {iteration}" if iteration is not None else ""
        msg = (f"run.dir={self.run_dir}: writing {name}{at} failed: {cause}; free space there or pick another "
               "run.dir= (the rows already written are kept)")
        if name != LOG_FILE:  # train.log may still take the line (a quota on one file, or a few bytes left)
            try:
                self._log.write(f"error: {msg}\n")
                self._log.flush()
            except OSError:
                pass
        return StorageError(msg, all_ranks=False)

    def iteration_prefix(self, iteration: int) -> str:
        """``iter N/T`` (``iter N`` without a total): how every line of an iteration starts."""
        return f"iter {iteration}" + (f"/{self.train_iters}" if self.train_iters is not None else "")

    def write_train(self, row: TrainRow, *, step_time_s: Optional[float] = None) -> Optional[IntervalMeans]:
        """Append a train row (its iteration took ``step_time_s`` seconds; None: unknown); every
        `log_interval` iterations and on the last, print / log the step line of the interval it closes.

        Returns:
            the closed interval's `IntervalMeans` when this row printed a line, else None (also on other ranks).
        """
        if not self.active:
            return None
        self._write_row(row.as_dict())
        self.interval.add(row, step_time_s)  # values already on the host: no device read
        postfix = None if row.lm_loss is None else f"lm_loss={row.lm_loss:.4f}"
        if row.iteration % self.log_interval != 0 and row.iteration != self.train_iters:
            self.console.step(row.iteration, None, postfix=postfix)  # the bar moves every iteration
            return None
        means = self.interval.close()
        line = format_train_line(row, means, self.train_iters)
        self._log_line(line)
        self.console.step(row.iteration, line, postfix=postfix)
        return means

    def write_eval(self, row: EvalRow) -> None:
        """Append a valid / test row and print its line."""
        if not self.active:
            return
        data = row.as_dict()
        self._write_row(data)
        self.message(
            f"{self.iteration_prefix(row.iteration)} | {row.split} lm_loss {data['lm_loss']:.6f} | ppl {_fmt(data['ppl'], '.3f')}"
        )

    def message(self, text: str, *, console: bool = True) -> None:
        """A line in train.log and, unless ``console`` is False, on the console (rank 0)."""
        if not self.active:
            return
        self._log_line(text)
        if console:
            self.console.message(text)

    def close(self) -> None:
        """Close the files, the bar, and detach from the `mptrain` logger (idempotent)."""
        if not self.active:
            return
        if self._handler is not None:
            logger = logging.getLogger("mptrain")
            logger.removeHandler(self._handler)
            logger.setLevel(self._old_level)
            self._handler = None
        if self.console is not None:
            self.console.close()
        for f in (self._metrics, self._log):
            if f is not None and not f.closed:
                f.close()
        self.active = False

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclasses.dataclass
class _PendingRow:
    iteration: int
    consumed: int
    outcome: Any  # training.step.IterationOutcome
    t_begin: float  # time.time() when its train_step began
    step_time_s: Optional[float] = None  # until the next iteration begins (or a flush): the iteration period


class TrainRows:
    """The loop's metrics.jsonl train rows, written in iteration order once their iteration is settled
    (``train.defer_step_read``: by the next `Trainer.train_step`) and its time is known.

    An iteration's time (the row's tokens/s) is the wall time from the start of its train_step to the
    start of the next one, or to a flush before an evaluation, a save or the end (which it excludes):
    the period at which iterations go through, as Megatron's interval timer. The duration of a
    train_step call alone is not: with a deferred read the wait for the device falls in the next one.

    Args:
        recorder: `mptrain.training.recorder.Recorder` (its ``train_row`` writes a row).
        trainer: the `mptrain.training.step.Trainer` whose outcomes the rows report.
        stop: the loop's `mptrain.training.watchdog.StopSignal`; its grace scales with the last ``step_time_s``.
    """

    def __init__(self, recorder: Any, trainer: Any, stop: Any) -> None:
        self.recorder, self.trainer, self.stop = recorder, trainer, stop
        self.waiting: list[_PendingRow] = []
        self.t_begin = time.time()

    def begin(self) -> None:
        """An iteration starts now: this ends the previous one's time, and writes its row if it is settled."""
        self.t_begin = time.time()
        self._close(self.t_begin)
        self._write_ready()

    def add(self, iteration: int, consumed: int, outcome: Any) -> None:
        """Queue the iteration that just ran; write every row that is ready."""
        self.waiting.append(_PendingRow(iteration, consumed, outcome, self.t_begin))
        self._write_ready()

    def _write_ready(self) -> None:
        while self.waiting and self.waiting[0].outcome.is_settled and self.waiting[0].step_time_s is not None:
            self._write(self.waiting.pop(0))

    def flush(self) -> None:
        """Settle every waiting row (a host sync), end the current iteration's time there, write them."""
        for row in self.waiting:
            row.outcome.metrics()
        self._close(time.time())
        while self.waiting:
            self._write(self.waiting.pop(0))

    def _close(self, now: float) -> None:
        if self.waiting and self.waiting[-1].step_time_s is None:
            self.waiting[-1].step_time_s = now - self.waiting[-1].t_begin
            self.stop.step_time_s = self.waiting[-1].step_time_s  # the stop signal's grace scales with it

    def _write(self, row: _PendingRow) -> None:
        self.recorder.train_row(row.iteration, row.consumed, row.outcome.metrics(), self.trainer,
                                step_time_s=row.step_time_s)

    @contextlib.contextmanager
    def written_on_failure(self):
        """A training step that raises still leaves the rows of the iterations before it (best effort:
        a row that cannot be settled any more is dropped; the step's own error is what propagates)."""
        try:
            yield
        except BaseException:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - e.g. the skip limit, or a device error: the first error wins
                self.waiting.clear()
            raise
