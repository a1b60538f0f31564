"""Python's cyclic garbage collector under the trainer's control (``train.manual_gc``; Megatron's
``--manual-gc``, ``--manual-gc-interval``, ``--no-manual-gc-eval``; torchtitan's ``training.gc_freq``).

By default CPython runs a collection whenever enough container objects were allocated since the
last one: at a moment no rank chooses, and a full collection traverses every live object (torch,
Dynamo, sympy, Hydra: millions after start-up). In a host-bound step that is a pause on one rank
that its peers wait for in the next collective. With ``train.manual_gc=true`` automatic collection
is off for the training loop; one full collection runs at its start, every
``train.manual_gc_interval`` iterations (0 = never again), and before and after each evaluation
(``train.manual_gc_eval``), so that all ranks collect at the same iteration. Memory held by
reference cycles between collections is what this trades for it (reference counting still frees
everything else at once). Nothing changes in the numbers a run computes.
"""

from __future__ import annotations

import contextlib
import gc


class ManualGC:
    """``with ManualGC(enabled, interval, eval_collect):`` around the training loop.

    Args:
        enabled: ``train.manual_gc``. interval: ``train.manual_gc_interval`` (iterations, >= 0; 0 = only at the
            start). eval_collect: ``train.manual_gc_eval``.
    On exit automatic collection is back as it was on entry (a sweep's next job, the test pool).
    """

    def __init__(self, enabled: bool, interval: int = 0, eval_collect: bool = True) -> None:
        self.enabled, self.interval, self.eval_collect = bool(enabled), int(interval), bool(eval_collect)
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> "ManualGC":
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> bool:
        """Collect after `iteration` (counted from 1) when it is a multiple of the interval; returns whether it did."""
        if self.enabled and self.interval > 0 and iteration % self.interval == 0:
            gc.collect()
            return True
        return False

    @contextlib.contextmanager
    def evaluation(self):
        """Around an evaluation: a collection before and after it (``train.manual_gc_eval``)."""
        collect = self.enabled and self.eval_collect
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect()
