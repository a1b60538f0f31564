"""Ending a stuck rank: the stop signal's grace period and the per-step heartbeat (DESIGN.md §4, §5).

A rank whose peer died or stalled sits inside a collective wait. On GPUs that wait is C++ code
(a CUDA stream sync behind `.item()`, NCCL's own watchdog) that may never return to the Python
interpreter, so nothing that needs the main thread to run Python can end it:

- `StopSignal` (SIGTERM / SIGINT): finish the step, save, exit 0; if the step does not finish
  within a grace period, exit 1. The grace timer is started from a reader thread woken through
  `signal.set_wakeup_fd` (CPython's C-level handler writes the signal number there at once, in
  whichever thread took the signal), not only from the Python-level handler, which runs in the
  main thread at its next bytecode and so never runs while that thread is stuck in C++.
- `StepWatchdog`: a heartbeat armed around each training step once `train.step_timeout_s` is set
  (what NeMo / nvidia-resiliency call a rank heartbeat timeout). NCCL's own timeout at
  `step_timeout_s` gets the first chance to fail the collective; this is the backstop that ends
  the process at `step_timeout_s + max(10 s, step_timeout_s)` when that did not happen.

Both end the process with `os._exit(1)` from a daemon thread: no Python cleanup runs (a cleanup
that waits on a dead peer would hang too), and torchrun then stops the other ranks. Both threads
need the GIL, which torch releases while it waits in a collective or a stream sync.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
MIN_STOP_GRACE_S = 10.0  # seconds a step gets to finish after a stop signal, at least
MIN_STEP_GRACE_S = 10.0  # seconds past train.step_timeout_s before StepWatchdog ends the process, at least


class StopSignal:
    """SIGTERM / SIGINT: finish the current step, save, exit 0 (DESIGN.md §4).

    The step must finish within a grace period of ``max(min_grace_s, 3 × step_time_s)`` seconds
    after the signal (``step_time_s`` is the last step's wall time, set by the loop); a rank stuck
    in a collective whose peer died never gets there, so a timer thread then prints one line and
    ends the process with exit 1 (torchrun's own SIGTERM on a peer's failure otherwise waits 30 s
    before its SIGKILL).

    Contract with the loop: `install()` before the loop (main thread; elsewhere, e.g. in a test
    pool worker, it installs nothing), read `.received` between steps, `acknowledge()` once every
    rank has seen the signal (the save may then take its time), `uninstall()` in `finally`.
    Evaluation and checkpoint saves run inside `untimed()`: they may legitimately outlast the grace,
    so a signal that arrives there starts its timer only when they end.

    Two paths start the grace timer, whichever runs first (the start is idempotent, under a lock):
    the Python handler `_handle` (main thread, next bytecode; it also sets `.received`), and a
    reader thread blocked on the wakeup fd, which CPython's C-level handler writes the signal
    number to immediately, even while the main thread is inside C++ that never returns. While
    installed, this object owns the process's wakeup fd; bytes are forwarded to the previous one.
    """

    def __init__(self, *, min_grace_s: float = MIN_STOP_GRACE_S, exit_fn: Callable[[int], None] = os._exit) -> None:
        self.received = False
        self.signum: Optional[int] = None  # the signal received (SIGINT: the entry point then exits 130)
        self.step_time_s = 0.0
        self.min_grace_s = min_grace_s
        self._exit_fn = exit_fn
        self._lock = threading.RLock()  # re-entrant: `_handle` runs in the main thread, maybe while it holds the lock
        self._untimed_depth = 0
        self._deferred: Optional[int] = None  # a signal number that arrived inside `untimed()`
        self._timer: Optional[threading.Timer] = None
        self._previous_handlers: dict = {}
        self._previous_wakeup_fd = -1
        self._read_fd: Optional[int] = None
        self._write_fd: Optional[int] = None
        self._reader: Optional[threading.Thread] = None

    @property
    def grace_s(self) -> float:
        """Seconds the current step gets after a signal: ``max(min_grace_s, 3 × step_time_s)``."""
        return max(self.min_grace_s, 3.0 * self.step_time_s)

    def install(self) -> None:
        """Install the handlers and the wakeup-fd reader; a no-op outside the main thread or when installed."""
        if self._write_fd is not None or threading.current_thread() is not threading.main_thread():
            return  # signal APIs are main-thread only (a test pool worker gets no signal handling)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it: the C handler must never block
        try:
            for sig in STOP_SIGNALS:
                self._previous_handlers[sig] = signal.signal(sig, self._handle)
            self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except BaseException:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()
            os.close(read_fd)
            os.close(write_fd)
            raise
        self._read_fd, self._write_fd = read_fd, write_fd
        self._reader = threading.Thread(target=self._read_wakeups, args=(read_fd,), name="mptrain-stop-signal",
                                        daemon=True)
        self._reader.start()

    def _read_wakeups(self, read_fd: int) -> None:
        """Reader thread: each byte is a signal number from the C-level handler; EOF = uninstalled."""
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return  # uninstall() closed the write end
            if self._previous_wakeup_fd >= 0:
                try:
                    os.write(self._previous_wakeup_fd, data)  # whoever owned the wakeup fd before (asyncio, ...)
                except OSError:
                    pass
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._start_grace(signum)

    def _handle(self, signum, frame) -> None:
        self.received = True
        self.signum = signum
        self._start_grace(signum)

    def _start_grace(self, signum: int) -> None:
        """Start the grace timer once per installation, from whichever thread sees the signal first."""
        with self._lock:
            if self._timer is not None:
                return  # already running, or acknowledged: a second signal during the save adds nothing
            if self._untimed_depth > 0:
                self._deferred = signum  # started when `untimed()` ends
                return
            grace_s = self.grace_s
            self._timer = threading.Timer(grace_s, self._exit_stuck, args=(signum, grace_s))
            self._timer.daemon = True
            self._timer.start()

    @contextlib.contextmanager
    def untimed(self):
        """A region the grace does not time (evaluation, a checkpoint save): a signal received inside
        starts its grace timer when the region ends (``.received`` is set at once as usual)."""
        with self._lock:
            self._untimed_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._untimed_depth -= 1
                signum = self._deferred if self._untimed_depth == 0 else None
                if signum is not None:
                    self._deferred = None
                    self._start_grace(signum)

    def _exit_stuck(self, signum: int, grace_s: float) -> None:
        sys.stderr.write(f"error: signal {signum} received but the step did not finish within {grace_s:g} s "
                         "(a peer rank failed?); exiting\n")
        sys.stderr.flush()
        self._exit_fn(1)

    def acknowledge(self) -> None:
        """The loop saw the signal between steps: saving and exiting normally, no grace timer needed."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()

    def uninstall(self) -> None:
        """Cancel the timer, restore the previous handlers and wakeup fd, stop the reader, close the fds."""
        self.acknowledge()
        if self._write_fd is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup_fd)  # first: the C handler must stop writing to our pipe
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()
        os.close(self._write_fd)  # the reader's os.read returns b"": it exits
        self._reader.join(timeout=5.0)
        os.close(self._read_fd)
        self._read_fd = self._write_fd = self._reader = None
        self._previous_wakeup_fd = -1


class StepWatchdog:
    """Rank heartbeat: ends the process when an armed training step outlives its limit.

    ``limit_s = step_timeout_s + grace_s`` with ``grace_s = max(10 s, step_timeout_s)`` by default:
    NCCL's (or gloo's) own collective timeout at ``step_timeout_s`` gets the first chance to raise
    (the rank then reports its traceback and exits through the normal error path); this is the
    backstop for when it does not (NCCL's watchdog noticed the timeout but the process lingered in
    its flight-recorder dump / heartbeat wait; a stalled rank itself, which no collective catches).
    On expiry it writes one line to stderr and calls ``exit_fn(1)`` (``os._exit``), once.

    The loop calls `arm(iteration)` before a step and `disarm()` after it; evaluation and
    checkpoint saves run disarmed (they can legitimately take long). No signal APIs: it works in
    any thread. The thread sleeps on a condition until the deadline or the next arm/disarm.

    Raises:
        ValueError: ``step_timeout_s`` or ``grace_s`` not positive.
    """

    def __init__(self, step_timeout_s: float, *, rank: int, grace_s: Optional[float] = None,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        if grace_s is None:
            grace_s = max(MIN_STEP_GRACE_S, step_timeout_s)
        if not step_timeout_s > 0 or not grace_s > 0:
            raise ValueError(f"StepWatchdog needs step_timeout_s > 0 and grace_s > 0, got {step_timeout_s} and "
                             f"{grace_s}; set train.step_timeout_s to a positive number of seconds, or null")
        self.step_timeout_s = step_timeout_s
        self.limit_s = step_timeout_s + grace_s
        self.rank = rank
        self._exit_fn = exit_fn
        self._cond = threading.Condition()
        self._deadline: Optional[float] = None  # time.monotonic() seconds; None = disarmed
        self._iteration = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name="mptrain-step-watchdog", daemon=True)
        self._thread.start()

    def arm(self, iteration: int) -> None:
        """Start timing `iteration` (the one about to run, counted from 1)."""
        with self._cond:
            self._iteration = iteration
            self._deadline = time.monotonic() + self.limit_s
            self._cond.notify()

    def disarm(self) -> None:
        """The step finished (or the loop left the step): stop timing."""
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def stop(self) -> None:
        """Disarm and end the thread (idempotent)."""
        with self._cond:
            self._stopped = True
            self._deadline = None
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()  # disarmed: sleep until arm() or stop()
                    continue
                remaining_s = self._deadline - time.monotonic()
                if remaining_s > 0:
                    self._cond.wait(remaining_s)
                    continue
                self._deadline = None  # fire once (exit_fn does not return in production)
                iteration = self._iteration
                break
            else:
                return
        sys.stderr.write(f"error: rank {self.rank}: iteration {iteration} did not finish within {self.limit_s:g} s "
                         f"(train.step_timeout_s={self.step_timeout_s:g}); a peer rank failed or stalled; exiting\n")
        sys.stderr.flush()
        self._exit_fn(1)


class StepTimeout:
    """``train.step_timeout_s`` as the collective timeout of every group (`ParallelGroups.set_timeout`)
    from the end of this process's first step (which may compile / autotune under
    ``train.timeout_s``) to the last training step. Evaluation and checkpoint saves run under
    ``train.timeout_s`` (`suspended`): one rank may legitimately take longer there (rank 0 publishes
    and prunes checkpoints; uneven shards) while its peers wait in a collective."""

    def __init__(self, groups: Any, timeout_s: float, step_timeout_s: Optional[float]) -> None:
        self.groups, self.timeout_s, self.step_timeout_s = groups, timeout_s, step_timeout_s
        self.on = False

    def start(self) -> None:
        if self.step_timeout_s is not None:
            self.groups.set_timeout(self.step_timeout_s)
            self.on = True

    def end(self) -> None:
        if self.on:
            self.groups.set_timeout(self.timeout_s)
            self.on = False

    @contextlib.contextmanager
    def suspended(self):
        if not self.on:
            yield
            return
        self.groups.set_timeout(self.timeout_s)
        try:
            yield
        finally:
            self.groups.set_timeout(self.step_timeout_s)


class LoopWatch:
    """What ends a stuck rank, as the training loop drives it: the heartbeat (`StepWatchdog`, or None)
    armed around each step from this process's second on, the stop signal's grace, and the step
    timeout of the collectives (`StepTimeout`), started after this process's first step.

    This process's first step (the first `arm`ed iteration: one past a resumed checkpoint's) may
    compile / autotune for minutes under the long start-up timeout: neither the heartbeat nor a
    signal's grace times it. Evaluation and saves run in `untimed`.
    """

    def __init__(self, groups: Any, *, timeout_s: float, step_timeout_s: Optional[float], stop: StopSignal,
                 heartbeat: Optional[StepWatchdog]) -> None:
        self.stop, self.heartbeat = stop, heartbeat
        self.step_timeout = StepTimeout(groups, timeout_s, step_timeout_s)
        self.first_iteration: Optional[int] = None
        self._armed = False

    def arm(self, iteration: int) -> None:
        """`iteration` (from 1) is about to run: the heartbeat times it unless it is this process's first."""
        if self.first_iteration is None:
            self.first_iteration = iteration
        self._armed = self.heartbeat is not None and iteration > self.first_iteration
        if self._armed:
            self.heartbeat.arm(iteration)

    def first_step_untimed(self, iteration: int):
        """Around the step itself: a signal's grace starts after this process's first step."""
        return self.stop.untimed() if iteration == self.first_iteration else contextlib.nullcontext()

    def step_done(self, iteration: int) -> None:
        """`iteration` finished: disarm the heartbeat (evaluation and saves may legitimately take long; after
        a failure mid-step it is not called, and the heartbeat stays armed through the cleanup)."""
        if self._armed:
            self.heartbeat.disarm()
        if iteration == self.first_iteration:
            self.step_timeout.start()  # catches a stalled rank (DESIGN.md §5)

    @contextlib.contextmanager
    def untimed(self):
        """Evaluation and saves: timed by neither the step timeout (`StepTimeout.suspended`) nor a
        stop signal's grace (`StopSignal.untimed`)."""
        with self.stop.untimed(), self.step_timeout.suspended():
            yield

    def end(self) -> None:
        """No more training steps: collectives go back to ``train.timeout_s``."""
        self.step_timeout.end()
