"""Validation and test evaluation of the training loop (Megatron's ``evaluate_and_print_results``): when it
runs (`Evaluator.should_evaluate`, `at_start`, `at_end`) and the rows it writes.

With ``train.eval_interval`` set and ``train.eval_iters > 0``: a ``valid`` row at iteration 0 of a fresh
run, one after every ``eval_interval``-th iteration before the last, and ``valid`` + ``test`` rows after
the last iteration this process trained (not after a stop by signal or ``train.exit_interval``). A
split that ``data.split`` left empty has no rows (one log line says why).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterator

from mptrain.data.provider import empty_split_reason
from mptrain.training.step import chunk_needs_data

SPLITS = ("valid", "test")


def data_iterators(built: Any, make: Callable[[], Iterator]) -> list:
    """One iterator per model chunk of ``built``: ``make()`` on the TP-rank-0 reader of a chunk that needs
    data (`chunk_needs_data`), None elsewhere (the batch reaches the other TP ranks by broadcast)."""
    with_mask = bool(built.cfg.data.reset_attention_mask)
    return [make() if (built.groups.tp_rank == 0 and chunk_needs_data(c, with_mask)) else None for c in built.chunks]


class Evaluator:
    """The loop's evaluations: forward-only passes over ``train.eval_iters`` global batches of a split.

    Args:
        built: the job's runtime objects (`mptrain.training.run.Built`).
        recorder: `mptrain.training.recorder.Recorder` (log lines and ``valid`` / ``test`` rows).
        untimed: a context factory for the evaluation's time (`mptrain.training.watchdog.LoopWatch.untimed`).
        collector: the loop's `mptrain.training.manual_gc.ManualGC` (collections around an evaluation).
    """

    def __init__(self, built: Any, recorder: Any, *, untimed: Callable[[], ContextManager], collector: Any) -> None:
        self.built, self.recorder, self.untimed, self.collector = built, recorder, untimed, collector
        train = built.cfg.train
        self.enabled = train.eval_interval is not None and train.eval_iters > 0

    def should_evaluate(self, iteration: int) -> bool:
        """A periodic validation after `iteration` (the last iteration's is `at_end`'s)."""
        train = self.built.cfg.train
        return self.enabled and iteration % train.eval_interval == 0 and iteration < train.train_iters

    def at_start(self, iteration: int) -> None:
        """Before the loop: say which splits have no rows; validate a fresh run at iteration 0."""
        for split in SPLITS:
            if self.enabled and not self.built.provider.has_split(split):
                self.recorder.log(f"{empty_split_reason(self.built.cfg.data, split)}: no {split} rows")
        if self.enabled and iteration == 0:
            self.evaluate("valid", iteration)

    def at_end(self, iteration: int, *, trained: bool) -> None:
        """After the loop ran to ``train.train_iters``: ``valid`` and ``test`` rows, when this process
        `trained` at least one iteration."""
        if self.enabled and trained:
            for split in SPLITS:
                self.evaluate(split, iteration)

    def evaluate(self, split: str, iteration: int) -> None:
        """Write a `split` row at `iteration`; a split that ``data.split`` left empty has no rows."""
        provider = self.built.provider
        if not provider.has_split(split):
            return

        def make() -> list:
            return data_iterators(self.built, lambda: provider.eval_iterator(split))

        with self.untimed(), self.collector.evaluation():
            loss = self.built.trainer.evaluate(make, self.built.cfg.train.eval_iters)
        self.recorder.eval_row(split, iteration, loss)
