"""``train.manual_gc`` (Megatron's ``--manual-gc``): automatic collection off for the training loop,
full collections at the start, every ``manual_gc_interval`` iterations and around evaluations, the
same on every rank; nothing the run computes changes, and automatic collection is back afterwards."""

from __future__ import annotations

import gc
import json

import pytest

from harness import run_distributed
from mptrain.errors import ConfigError
from mptrain.training.manual_gc import ManualGC
from train_utils import compose, run_job, without_timing


class _Collections:
    """Full collections that start while automatic collection is off (so: the manual ones)."""

    def __init__(self):
        self.manual = 0

    def __call__(self, phase, info):
        if phase == "start" and info["generation"] == 2 and not gc.isenabled():
            self.manual += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def test_collections_at_start_interval_and_around_evaluation():
    assert gc.isenabled()
    with _Collections() as seen:
        with ManualGC(True, interval=3) as collector:
            assert not gc.isenabled()
            done = [i for i in range(1, 8) if collector.after_iteration(i)]
            with collector.evaluation():
                pass
        assert gc.isenabled()  # back as it was
        assert done == [3, 6]
        assert seen.manual == 1 + 2 + 2  # start, iterations 3 and 6, before and after the evaluation
    with _Collections() as seen:
        with ManualGC(False, interval=1) as collector:
            assert gc.isenabled()
            assert not collector.after_iteration(1)
            with collector.evaluation():
                pass
        assert seen.manual == 0


def test_collection_left_off_stays_off():
    gc.disable()
    try:
        with ManualGC(True, interval=0) as collector:
            assert not collector.after_iteration(5)  # 0: only at the start
        assert not gc.isenabled()  # the caller's choice survives the loop
    finally:
        gc.enable()


def test_negative_interval_is_one_line():
    from mptrain.config.schema import as_config
    from mptrain.training.validate import check_training_keys

    cfg = as_config(compose(["train.manual_gc=true", "train.manual_gc_interval=-1"]))
    with pytest.raises(ConfigError, match=r"^train\.manual_gc_interval=-1 must be >= 0"):
        check_training_keys(cfg)


JOB = ["model=tiny", "parallel=tp1pp1", "train.global_batch_size=8", "train.micro_batch_size=2", "train.train_iters=4",
       "train.eval_interval=2", "train.eval_iters=1", "run.progress_bar=false"]


def _counted_job(rank, world, overrides):
    with _Collections() as seen:
        run_job(rank, world, overrides)
    return seen.manual, gc.isenabled()


def _rows(run_dir):
    return without_timing([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


def test_two_ranks_collect_alike_and_compute_the_same(tmp_path):
    manual = run_distributed(_counted_job, 2, [*JOB, "train.manual_gc=true", "train.manual_gc_interval=2",
                                               f"run.dir={tmp_path}/manual"])
    # in the loop: the start, iterations 2 and 4, before and after the evaluation at iteration 2 (the
    # evaluations at 0 and after the loop run with automatic collection on); automatic collection back after
    assert manual == [(5, True), (5, True)]
    auto = run_distributed(_counted_job, 2, [*JOB, f"run.dir={tmp_path}/auto"])
    assert auto == [(0, True), (0, True)]
    assert _rows(tmp_path / "manual") == _rows(tmp_path / "auto")
