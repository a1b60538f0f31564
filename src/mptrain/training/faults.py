"""The ``debug.*`` keys (DESIGN.md §1): test-only fault injection as a hook object on the loop, and the
memory-snapshot switch. Nothing here runs unless a ``debug.*`` key asks for it: `install_fault_hooks`
returns no hook when no fault is configured for this rank, and the loop's hook list stays empty.

Faults (iterations numbered as the loop's, from 1; `FaultHook`):

- ``debug.fail_rank`` + ``debug.fail_iteration`` (+ ``debug.fail_where``, ``debug.fail_kind``): that rank
  fails at one of `FAULT_SITES` (the batch read, the forward step, the checkpoint save, the checkpoint
  write) by raising or by SIGKILL, on torchrun's first attempt only.
- ``debug.nonfinite_grad_rank`` + ``debug.nonfinite_grad_iteration``: NaN grads on that rank's
  model-parallel position at that iteration, after the DP reduction.
- ``debug.sleep_rank`` + ``debug.sleep_seconds``: that rank stalls inside its second step (the rank
  heartbeat of ``train.step_timeout_s`` is armed there).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

from mptrain.errors import check_choice
from mptrain.training.memory import memory_snapshot
from mptrain.training.step import chunk_needs_data

FAULT_SITES = ("forward", "data", "save", "save_write")
"""Where ``debug.fail_where`` can inject a failure: the `FaultInjector.maybe_fail` call sites (the forward
step, the batch read, the checkpoint save of the loop, the checkpoint write: `mptrain.checkpoint.writer` calls
the checkpointer's ``before_write``, `mptrain.training.checkpointing.Checkpointer`)."""


FAULT_KINDS = ("raise", "sigkill")
"""How an injected failure fails (``debug.fail_kind``): see `FaultInjector`."""

SLEEP_ITERATION = 2  # the step that ``debug.sleep_rank`` stalls in: the heartbeat arms from the second step on


def check_fault_config(debug) -> None:
    """``debug.fail_where`` is one of `FAULT_SITES`, ``debug.fail_kind`` one of `FAULT_KINDS`; pure (called
    by `validate_config`).

    Raises:
        ConfigError: naming the key, the value and the valid sites.
    """
    check_choice("debug.fail_where", debug.fail_where, FAULT_SITES)
    check_choice("debug.fail_kind", debug.fail_kind, FAULT_KINDS)


@dataclasses.dataclass
class FaultInjector:
    """The ``debug.fail_*`` failure of DESIGN.md §1 for this rank (all None = off).

    `fail_kind`: "raise" (a RuntimeError) or "sigkill" (the process kills itself with SIGKILL, as a
    lost node or the OOM killer would). It fires on torchrun's first attempt only (`attempt` =
    TORCHELASTIC_RESTART_COUNT = 0), so a job restarted by ``--max-restarts`` runs through.
    `iteration` is the iteration running now (set by `FaultHook.before_step`).
    """

    rank: int
    fail_rank: Optional[int] = None
    fail_iteration: Optional[int] = None
    fail_where: str = "forward"
    fail_kind: str = "raise"
    attempt: int = 0
    iteration: int = 0

    def maybe_fail(self, where: str) -> None:
        assert where in FAULT_SITES, where  # a new call site is added to FAULT_SITES too
        if (self.fail_rank == self.rank and self.fail_iteration == self.iteration and self.fail_where == where
                and self.attempt == 0):
            if self.fail_kind == "sigkill":
                import os
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"debug: injected failure on rank {self.rank} at iteration {self.iteration} in {where}")


class FaultHook:
    """This rank's ``debug.*`` faults as a loop hook: `install` wraps the trainer's forward step and grad
    finalisation, the loop calls `before_step` (heartbeat armed) and `before_save`.

    Args:
        injector: the ``debug.fail_*`` failure (`FaultInjector`), or None.
        poison_iteration: the iteration whose grads this rank fills with NaN, or None.
        sleep_seconds: how long this rank stalls in iteration `SLEEP_ITERATION` (0 = not at all).
        chunks: the DDP-wrapped model chunks (their main grads are poisoned).
        with_attention_mask: ``data.reset_attention_mask`` (which chunks read a batch: `chunk_needs_data`).
    """

    def __init__(self, *, injector: Optional[FaultInjector], poison_iteration: Optional[int], sleep_seconds: float,
                 chunks: list, with_attention_mask: bool) -> None:
        self.injector, self.poison_iteration, self.sleep_seconds = injector, poison_iteration, sleep_seconds
        self.chunks, self.with_attention_mask = chunks, with_attention_mask
        self.iteration = 0

    def install(self, trainer: Any) -> None:
        """Wrap ``trainer.forward_step`` (the data / forward sites) and ``trainer.finalize_model_grads``
        (the poison, right after the DP reduction)."""
        if self.injector is not None:
            trainer.forward_step = self._failing_forward_step(trainer.forward_step)
        if self.poison_iteration is not None:
            trainer.finalize_model_grads = self._poisoning_finalize(trainer.finalize_model_grads)

    def before_step(self, iteration: int) -> None:
        """`iteration` (from 1) starts now; a stalled rank stalls here."""
        self.iteration = iteration
        if self.injector is not None:
            self.injector.iteration = iteration
        if self.sleep_seconds > 0 and iteration == SLEEP_ITERATION:
            time.sleep(self.sleep_seconds)  # a rank stalled inside its step: the heartbeat is armed

    def before_save(self, iteration: int) -> None:
        """The loop's checkpoint save of `iteration` starts now."""
        if self.injector is not None:
            self.injector.maybe_fail("save")

    def _failing_forward_step(self, forward_step: Callable) -> Callable:
        injector = self.injector

        def forward_step_with_faults(data_iterator, model):
            if chunk_needs_data(model, self.with_attention_mask):
                injector.maybe_fail("data")
            injector.maybe_fail("forward")
            return forward_step(data_iterator, model)

        return forward_step_with_faults

    def _poisoning_finalize(self, finalize: Callable) -> Callable:
        def finalize_then_poison(*args, **kwargs):
            total = finalize(*args, **kwargs)
            if self.iteration == self.poison_iteration:
                for chunk in self.chunks:
                    for _, _, grad in chunk.named_main_grads()[:1]:
                        grad.fill_(float("nan"))
            return total

        return finalize_then_poison


def install_fault_hooks(built: Any, *, attempt: int) -> list:
    """The loop hooks of ``built.cfg.debug`` for this rank, installed on ``built.trainer``: ``[FaultHook]``,
    or ``[]`` when no fault concerns this rank. Sets ``built.faults`` (the injector whose ``save_write`` site
    the checkpointer hands to the checkpoint write) when ``debug.fail_rank`` is set.

    ``debug.nonfinite_grad_rank`` poisons every data-parallel replica of that rank's model-parallel
    position (where a NaN in one rank's local grads lands once the DP all-reduce has summed it in;
    poisoning one replica only would be a fault the DP reduction cannot produce, and under ZeRO-1 it
    could miss the shard owner).
    """
    dbg, groups = built.cfg.debug, built.groups
    injector = None
    if dbg.fail_rank is not None:
        injector = FaultInjector(rank=groups.rank, fail_rank=dbg.fail_rank, fail_iteration=dbg.fail_iteration,
                                 fail_where=dbg.fail_where, fail_kind=dbg.fail_kind, attempt=attempt)
    poisoned = dbg.nonfinite_grad_rank is not None and dbg.nonfinite_grad_rank in (groups.ranks.get("dp_cp") or groups.ranks["dp"])
    sleep_s = dbg.sleep_seconds if dbg.sleep_rank == groups.rank else 0
    if injector is None and not poisoned and not sleep_s > 0:
        return []
    hook = FaultHook(injector=injector, poison_iteration=dbg.nonfinite_grad_iteration if poisoned else None,
                     sleep_seconds=sleep_s, chunks=built.chunks,
                     with_attention_mask=bool(built.cfg.data.reset_attention_mask))
    hook.install(built.trainer)
    built.faults = injector
    return [hook]


def memory_snapshot_of(cfg: Any, *, device, run_dir, rank: int, log: Callable[[str], None]):
    """``debug.memory_snapshot``: CUDA allocator history over the loop, dumped on rank 0
    (`mptrain.training.memory.memory_snapshot`; a context that records nothing when off)."""
    return memory_snapshot(cfg.debug.memory_snapshot, device=device, run_dir=run_dir, rank=rank, log=log)
