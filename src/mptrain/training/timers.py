"""Named phase timers with Megatron's timing levels (megatron/core/timers.py, as an object, not a global).

    timers = Timers(log_level=cfg.train.timing_log_level, device=groups.device)
    with timers("forward-backward", 1):
        ...
    writer.message(timers.report(TIMER_LEVELS, normalizer=log_interval))   # ms per iteration

A timer above `log_level` is a shared no-op. On CUDA a timer records a pair of CUDA events on the
current stream at start / stop (no host sync); the elapsed time is computed, after synchronising
only the last stop event, when a timer is read (`elapsed_s`, `report`) — so read them at the log
interval, not per micro-batch. On CPU it uses `time.perf_counter` (work is synchronous there).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

# Megatron's names and levels: 0 = always, 1 = the main phases, 2 = fine-grained.
TIMER_LEVELS: dict[str, int] = {
    "interval-time": 0,  # one whole iteration
    "forward-backward": 1,  # the schedule call (all micro-batches, incl. pipeline p2p)
    "batch-generator": 1,  # reading / broadcasting a micro-batch (data)
    "grads-all-reduce": 1,  # finalize_model_grads: DP grad reduce (+ SP / embedding grads)
    "optimizer": 1,  # unscale, inf check, clip, step, copy to model params
    "pipeline-p2p": 1,  # send / recv between pipeline stages (inside forward-backward)
}


class _Timer:
    """One named timer accumulating elapsed time over start/stop pairs until read with reset."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.use_cuda = device.type == "cuda"
        self.running = False
        self._elapsed_s = 0.0
        self._events: list = []  # CUDA (start, stop) event pairs not yet folded into _elapsed_s
        self._t0 = 0.0

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"timer {self.name!r} started twice")
        self.running = True
        if self.use_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append([ev, None])
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if not self.running:
            raise RuntimeError(f"timer {self.name!r} stopped without start")
        self.running = False
        if self.use_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[-1][1] = ev
        else:
            self._elapsed_s += time.perf_counter() - self._t0

    def elapsed_s(self, reset: bool = True, wait: bool = True) -> float:
        """Seconds accumulated (a running timer counts up to now). On CUDA: ``wait`` syncs on the last
        stop event; ``wait=False`` counts only the intervals the device has finished and keeps the
        others for the next read (no host sync)."""
        was_running = self.running
        if was_running:
            self.stop()
        if self._events:
            if wait:
                self._events[-1][1].synchronize()  # host sync: only here, when the timer is read
            done = 0
            while done < len(self._events) and self._events[done][1].query():  # stream order: done ones first
                done += 1
            self._elapsed_s += sum(a.elapsed_time(b) for a, b in self._events[:done]) / 1000.0
            self._events = self._events[done:]
        value = self._elapsed_s
        if reset:
            self._elapsed_s = 0.0
        if was_running:
            self.start()
        return value

    def __enter__(self) -> "_Timer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _NullTimer:
    """The timer of a level above `log_level`: does nothing."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def elapsed_s(self, reset: bool = True, wait: bool = True) -> float:
        return 0.0

    def __enter__(self) -> "_NullTimer":
        return self

    def __exit__(self, *exc) -> None:
        pass


class Timers:
    """A set of named timers for one run (Megatron's `Timers`).

    Args:
        log_level: timers with a level above this are no-ops (`train.timing_log_level`, 0-2).
        device: CUDA devices use CUDA events; anything else wall-clock time.
    """

    def __init__(self, log_level: int = 1, device: torch.device = torch.device("cpu")) -> None:
        self.log_level = log_level
        self.device = torch.device(device)
        self._timers: dict[str, _Timer] = {}
        self._null = _NullTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer `name` (created on first use); its level defaults to `TIMER_LEVELS[name]` (else 1)."""
        level = TIMER_LEVELS.get(name, 1) if log_level is None else log_level
        if level > self.log_level:
            return self._null
        if name not in self._timers:
            self._timers[name] = _Timer(name, self.device)
        return self._timers[name]

    @property
    def empty(self) -> bool:
        """No timer has run (at ``log_level`` 0 none does: there is nothing to report)."""
        return not self._timers

    def elapsed_s(self, names: Optional[Iterable[str]] = None, reset: bool = True,
                  wait: bool = True) -> dict[str, float]:
        """{name: seconds} for the given (or all) active timers; names never started are left out
        (``wait``: see `_Timer.elapsed_s`)."""
        wanted = list(self._timers) if names is None else [n for n in names if n in self._timers]
        return {n: self._timers[n].elapsed_s(reset=reset, wait=wait) for n in wanted}

    def report(self, names: Optional[Iterable[str]] = None, *, normalizer: float = 1.0, reset: bool = True,
               wait: bool = True) -> str:
        """One log line: "times (ms): forward-backward 12.34 | optimizer 1.02 | ..." (elapsed / normalizer).

        Args:
            names: which timers (default all, in `TIMER_LEVELS` order where known).
            normalizer: divide by this (e.g. iterations since the last report) for ms per iteration.
            wait: False: no host sync; CUDA intervals the device has not finished yet count in the
                next report (the training loop's line, so that it never drains the device's queue).
        """
        if normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        if names is None:
            known = [n for n in TIMER_LEVELS if n in self._timers]
            order = known + sorted(n for n in self._timers if n not in TIMER_LEVELS)
        else:
            order = list(names)
        values = self.elapsed_s(order, reset=reset, wait=wait)
        body = " | ".join(f"{n} {1000.0 * s / normalizer:.2f}" for n, s in values.items())
        return f"times (ms): {body}" if body else "times (ms): -"
