"""The training loop's checkpoints and its early ends (DESIGN.md §4): where a job resumes
(`Checkpointer.resume`), when it saves (`should_save`), when it stops before ``train.train_iters``
(`stop_reason`: ``train.exit_interval`` or SIGTERM / SIGINT) and the save itself (`save`).

Checkpoint N is saved after iteration N: every ``checkpoint.save_interval``-th iteration, the last
one, and the one a stop ends on, when ``checkpoint.save`` is set.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager, Optional

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


class Checkpointer:
    """Loads, saves and the stop decisions of one job.

    Args:
        built: the job's runtime objects (`mptrain.training.run.Built`).
        recorder: `mptrain.training.recorder.Recorder` (the checkpoint's log lines).
        stop: the loop's `StopSignal` (installed by the loop).
        untimed: a context factory for a save's time (`mptrain.training.watchdog.LoopWatch.untimed`).
        hooks: loop hooks (``before_save(iteration)``; `mptrain.training.faults`), empty by default.
    """

    def __init__(self, built: Any, recorder: Any, *, stop: StopSignal, untimed: Callable[[], ContextManager],
                 hooks: list) -> None:
        self.built, self.recorder, self.stop, self.untimed, self.hooks = built, recorder, stop, untimed, hooks
        self.cfg = built.cfg

    def resume(self) -> Progress:
        """Load ``checkpoint.load`` when there is one (collective); zeros when the job starts fresh."""
        state = {"iteration": 0, "consumed_samples": 0}
        if self.cfg.checkpoint.load or self.cfg.checkpoint.save:
            from mptrain.checkpoint import maybe_load_checkpoint

            state = maybe_load_checkpoint(self.built, self.recorder)  # zeros when fresh
        return Progress(state["iteration"], state["consumed_samples"])

    def stop_reason(self, iteration: int) -> Optional[str]:
        """Why the loop ends after `iteration` before ``train.train_iters``: "exit_interval", "signal", or
        None. Called after every iteration on every rank (with ``checkpoint.save``: a collective)."""
        signalled = self._signal_received()
        exit_interval = self.cfg.train.exit_interval
        if exit_interval is not None and iteration >= exit_interval:
            return "exit_interval"
        return "signal" if signalled else None

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
        """Save checkpoint ``progress.iteration`` (collective; `mptrain.checkpoint.save_checkpoint`)."""
        from mptrain.checkpoint import save_checkpoint

        for hook in self.hooks:
            hook.before_save(progress.iteration)
        with self.untimed():
            save_checkpoint(self.built, iteration=progress.iteration, consumed_samples=progress.consumed_samples,
                            recorder=self.recorder)

    def wait(self) -> None:
        """``checkpoint.async_save``: the last save is published before the job ends."""
        if self.cfg.checkpoint.save:
            from mptrain.checkpoint.api import wait_for_saves

            wait_for_saves(self.built, self.recorder)
