"""The training loop's checkpoints and its early ends (DESIGN.md §4): where a job resumes
(`Checkpointer.resume`), when it saves (`should_save`), when it stops before ``train.train_iters``
(`stop_reason`: ``train.exit_interval``, ``train.exit_duration_in_mins`` or SIGTERM / SIGINT) and the save itself (`save`, blocking
or ``checkpoint.async_save``: `AsyncSaves`).

Checkpoint N is saved after iteration N: every ``checkpoint.save_interval``-th iteration, the last
one, and the one a stop ends on, when ``checkpoint.save`` is set.

The checkpoint package sees a `mptrain.checkpoint.TrainState` built here from the job's objects,
the config and the groups; the loop's other parts stay here: the async save's thread and process
group, the ``save_write`` fault site (a plain callable, `mptrain.training.faults`), the log.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from mptrain.checkpoint import TrainState
from mptrain.training.watchdog import StopSignal


@dataclasses.dataclass
class Progress:
    """Where the loop stands: completed iterations (from 1; skipped ones included) and consumed samples."""

    iteration: int
    consumed_samples: int

    def advance(self, global_batch_size: int) -> None:
        """One more iteration of `global_batch_size` samples completed."""
        self.iteration += 1
        self.consumed_samples += global_batch_size


class AsyncSaves:
    """``checkpoint.async_save``: at most one save in flight, written by a background thread.

    The thread runs the same write + checksum + publish as a blocking save
    (`mptrain.checkpoint.writer.write_and_publish`), over `group`: a gloo group of its own (created
    collectively, at the first async save) so that its collectives never interleave with the training
    loop's. `wait` (called before the next save, and by the loop before the job ends) joins it and
    re-raises its error on the main thread; ``latest`` is only rewritten by the thread, after every
    rank's files are written and checksummed.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.buffers: dict = {}  # pinned host copies reused by every save (`mptrain.checkpoint.writer.stage_to_host`)
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.message: Optional[str] = None

    def start(self, fn: Callable[[], str]) -> None:
        """Run ``fn`` (a save; returns its log line) in the background."""

        def target():
            try:
                self.message = fn()
            except BaseException as err:  # noqa: BLE001 - re-raised by wait() on the main thread
                self.error = err

        # daemon: a job failing with a save in flight must not hang at exit in that save's collectives (the
        # previous checkpoint stays the loadable one)
        self.thread = threading.Thread(target=target, name="mptrain-async-save", daemon=True)
        self.thread.start()

    def wait(self, log: Optional[Callable[..., None]] = None) -> None:
        """Block until the save in flight is published (no-op when none is); collective-free. Logs its line,
        or its error (``console=False``: the entry point prints it) and re-raises it."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread = None
        error, message, self.error, self.message = self.error, self.message, None, None
        if error is not None:
            if log is not None:
                log(f"error: {error}", console=False)  # the save thread could not log it
            raise error
        if log is not None:
            log(message)


class Checkpointer:
    """Loads, saves and the stop decisions of one job.

    Args:
        built: the job's runtime objects (`mptrain.training.run.Built`).
        recorder: `mptrain.training.recorder.Recorder` (the checkpoint's log lines), or None.
        stop: the loop's `StopSignal` (installed by the loop).
        untimed: a context factory for a save's time (`mptrain.training.watchdog.LoopWatch.untimed`).
        hooks: loop hooks (``before_save(iteration)``; `mptrain.training.faults`), empty by default.
        start_time: ``time.time()`` when the job started (``train.exit_duration_in_mins`` counts from it);
            None = now.
    """

    def __init__(self, built: Any, recorder: Any, *, stop: StopSignal, untimed: Callable[[], ContextManager],
                 hooks: list, start_time: Optional[float] = None) -> None:
        self.built, self.recorder, self.stop, self.untimed, self.hooks = built, recorder, stop, untimed, hooks
        self.cfg = built.cfg
        self.start_time = time.time() if start_time is None else start_time
        self.async_saves: Optional[AsyncSaves] = None  # created at the first ``checkpoint.async_save``

    def train_state(self, progress: Optional[Progress] = None) -> TrainState:
        """The objects a checkpoint saves and a load fills, at ``progress`` (zeros when None)."""
        built = self.built
        return TrainState(chunks=built.chunks, optimizer=built.trainer.optimizer,
                          lr_scheduler=built.trainer.lr_scheduler, rng_tracker=built.rng_tracker,
                          iteration=progress.iteration if progress else 0,
                          consumed_samples=progress.consumed_samples if progress else 0)

    def _log(self, text: str, *, console: bool = True) -> None:
        if self.recorder is not None:
            self.recorder.log(text, console=console)

    def resume(self) -> Progress:
        """Load ``checkpoint.load`` when there is one (collective); zeros when the job starts fresh."""
        state = self.train_state()
        if self.cfg.checkpoint.load or self.cfg.checkpoint.save:
            from mptrain.checkpoint import maybe_load_checkpoint

            maybe_load_checkpoint(state, cfg=self.cfg, groups=self.built.groups, log=self._log)  # zeros when fresh
        return Progress(state.iteration, state.consumed_samples)

    def stop_reason(self, iteration: int) -> Optional[str]:
        """Why the loop ends after `iteration` before ``train.train_iters``: "exit_interval", "exit_duration",
        "signal", or None. Called after every iteration on every rank (with ``checkpoint.save`` or
        ``train.exit_duration_in_mins``: a collective)."""
        signalled = self._signal_received()
        out_of_time = self._duration_exceeded()
        exit_interval = self.cfg.train.exit_interval
        if exit_interval is not None and iteration >= exit_interval:
            return "exit_interval"
        if out_of_time:
            return "exit_duration"
        return "signal" if signalled else None

    def _duration_exceeded(self) -> bool:
        """``train.exit_duration_in_mins``: the job's wall time since `start_time` exceeds it on any rank (Megatron
        all-reduces it with MAX), so every rank stops after the same iteration: always a collective when set,
        checkpoint.save or not (a rank leaving the loop alone would leave its peers waiting)."""
        limit = self.cfg.train.exit_duration_in_mins
        if limit is None:
            return False
        elapsed_min = (time.time() - self.start_time) / 60.0
        return self.built.groups.any_rank(elapsed_min > limit)

    def _signal_received(self) -> bool:
        """SIGTERM / SIGINT (`StopSignal`): finish this iteration, save it, exit 0. With ``checkpoint.save``
        every rank stops at the same iteration (any rank's signal stops all: they save together)."""
        received = self.built.groups.any_rank(self.stop.received) if self.cfg.checkpoint.save else self.stop.received
        if received:
            self.stop.acknowledge()  # every rank got here: the save below may take its time
        return received

    def should_save(self, iteration: int, *, stopping: bool) -> bool:
        """Save after `iteration`: a ``checkpoint.save_interval`` multiple, the last iteration, or a stop."""
        ckpt = self.cfg.checkpoint
        periodic = ckpt.save_interval and iteration % ckpt.save_interval == 0
        last = iteration == self.cfg.train.train_iters
        return bool(ckpt.save) and bool(periodic or stopping or last)

    def save(self, progress: Progress) -> None:
        """Save checkpoint ``progress.iteration`` (collective): blocking (`mptrain.checkpoint.save_checkpoint`),
        or with ``checkpoint.async_save`` copied to host memory and written in the background (`AsyncSaves`).

        Raises:
            StorageError: a write failed on any rank (async: the previous save's, raised here or by `wait`).
        """
        from mptrain.checkpoint import save_checkpoint

        for hook in self.hooks:
            hook.before_save(progress.iteration)
        self.built.trainer.finish_param_sync()  # the params the save reads are the last step's, landed
        with self.untimed():
            if self.cfg.checkpoint.async_save:
                self._save_async(progress)
            else:
                save_checkpoint(self.train_state(progress), cfg=self.cfg, groups=self.built.groups, log=self._log,
                                before_write=self._save_write_site())

    def _save_async(self, progress: Progress) -> None:
        """Wait for the previous async save, capture and copy this one to host memory (what blocks the loop;
        the copy reuses the previous save's pinned buffers), and hand the write to the `AsyncSaves` thread.
        Called only with ``checkpoint.save`` set (`should_save`)."""
        from mptrain.checkpoint import capture_save
        from mptrain.checkpoint.writer import stage_to_host, write_and_publish  # torch.distributed.checkpoint:
        # imported here, on the main thread and before the timing, never in the save's thread

        groups = self.built.groups
        t0 = time.perf_counter()
        saves = self.async_saves
        if saves is None:
            saves = self.async_saves = AsyncSaves(dist.new_group(backend="gloo"))  # collective: same point on all ranks
        saves.wait(self._log)
        save = stage_to_host(capture_save(self.train_state(progress), cfg=self.cfg, groups=groups), saves.buffers)
        before_write = self._save_write_site()
        saves.start(lambda: write_and_publish(save, rank=groups.rank, world_size=groups.world_size,
                                              device=torch.device("cpu"), group=saves.group, before_write=before_write))
        self._log(f"checkpoint: iteration {progress.iteration} copied to host memory, writing in the background; "
                  f"training blocked {time.perf_counter() - t0:.3f} s")

    def _save_write_site(self) -> Optional[Callable[[], None]]:
        """The ``save_write`` fault site (``debug.fail_where=save_write``: `mptrain.training.faults`), fired by the
        write once ``iter_N.tmp`` exists; None without ``debug.fail_rank``."""
        injector = getattr(self.built, "faults", None)
        if injector is None:
            return None
        frozen = dataclasses.replace(injector)  # its iteration frozen: the loop moves on during an async save
        return functools.partial(frozen.maybe_fail, "save_write")

    def wait(self) -> None:
        """``checkpoint.async_save``: the last save is published before the job ends."""
        if self.async_saves is not None:
            self.async_saves.wait(self._log)
