"""ZeRO-2 / ZeRO-3 (``parallel.data_parallel_sharding_strategy``, FSDP2) compute the one-process math (DESIGN.md §3).

Each pool task trains several layouts one after another (one task per world size: suite time); every job runs the
tiny model in fp32 for a few steps with two micro-batches per DP rank (gradient accumulation), and its per-step
lm_loss and grad_norm equal the single-process run's within rel 1e-5: sharding changes only the summation order
of the DP reduction (a reduce-scatter instead of an all-reduce) and of the grad norm's partial sums.
"""

from __future__ import annotations

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job, without_timing

STEPS = 4
BASE = ["model=tiny", f"train.train_iters={STEPS}", "train.eval_interval=null", "train.global_batch_size=8",
        "train.micro_batch_size=2", "run.progress_bar=false"]
Z2, Z3 = "parallel.data_parallel_sharding_strategy=optim_grads", "parallel.data_parallel_sharding_strategy=optim_grads_params"


def _jobs(rank: int, world: int, jobs: list) -> None:
    """Pool task: the training jobs ``[overrides]`` one after another."""
    for overrides in jobs:
        run_job(rank, world, BASE + overrides)


def _train(tmp_path, world: int, jobs) -> dict:
    """{name: metrics rows} of ``jobs`` ({name: overrides}, or [(name, overrides)] where a name may come back: a
    resumed job appends to its run folder) trained in one pool task of ``world`` ranks."""
    jobs = list(jobs.items()) if isinstance(jobs, dict) else list(jobs)
    run_distributed(_jobs, world, [o + [f"run.dir={tmp_path / n}"] for n, o in jobs], timeout_s=300)
    return {n: read_rows(tmp_path / n) for n, _ in jobs}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ref"), 1, {"tp1pp1": ["parallel=tp1pp1"]})["tp1pp1"]


def _assert_same(rows: list, ref: list, name: str) -> None:
    assert [r["iteration"] for r in rows] == list(range(1, STEPS + 1)), name
    for r, q in zip(rows, ref):
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=1e-5), (name, r["iteration"], r["lm_loss"], q["lm_loss"])
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-5), (name, r["iteration"], r["grad_norm"],
                                                                          q["grad_norm"])
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"], name  # it trained


FP16_OVERFLOW = ["parallel=tp1pp1", "precision=fp16", "loss_scaler.initial_scale=1024", "loss_scaler.hysteresis=1",
                 "debug.nonfinite_grad_rank=0", "debug.nonfinite_grad_iteration=2"]


def test_dp2_zero2_and_zero3_equal_one_process(tmp_path, reference):
    """fp32 against the one-process run; fp16 with an overflow injected into rank 0's grads at iteration 2
    against DDP (no_shard) with the same injection: the same steps skipped, the same loss scales."""
    ckpt = tmp_path / "ckpt"
    runs = _train(tmp_path, 2, [("dp2_z2", ["parallel=tp1pp1", Z2]), ("dp2_z3", ["parallel=tp1pp1", Z3]),
                                ("fp16_ddp", FP16_OVERFLOW), ("fp16_z3", FP16_OVERFLOW + [Z3]),
                                # ZeRO-3 saved after iteration 2 and resumed to 4
                                ("z3_split", ["parallel=tp1pp1", Z3, "train.exit_interval=2", f"checkpoint.save={ckpt}"]),
                                ("z3_split", ["parallel=tp1pp1", Z3, f"checkpoint.load={ckpt}", "train.seed=999"])])
    for name in ("dp2_z2", "dp2_z3"):
        _assert_same(runs[name], reference, name)
    # resume is bitwise: the floats read back from JSON are equal
    assert without_timing(runs["z3_split"]) == without_timing(runs["dp2_z3"])
    ddp, z3 = runs["fp16_ddp"], runs["fp16_z3"]
    assert [r["skipped_iter"] for r in z3] == [r["skipped_iter"] for r in ddp] == [False, True, False, False]
    assert [r["loss_scale"] for r in z3] == [r["loss_scale"] for r in ddp] == [1024.0, 512.0, 512.0, 512.0]
    assert z3[1]["grad_norm"] is None and z3[-1]["skipped_iters_total"] == 1
    for r, q in zip(z3, ddp):  # fp16 compute alike (params cast from the same fp32 values), fp32 reduction
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=1e-4), (r, q)


def test_tp2_and_pp2_by_dp2_equal_one_process(tmp_path, reference):
    # tp2 x dp2 with SP (norm grads all-reduced over TP on the shards), pp2 x dp2 (the tied embedding's copies
    # reduced over the embedding group on the shards), interleaved pp2 vpp2 x dp2
    runs = _train(tmp_path, 4, {"tp2dp2_sp_z3": ["parallel=tp2pp1", "parallel.sequence_parallel=true", Z3],
                                "tp2dp2_z2": ["parallel=tp2pp1", Z2],
                                "pp2dp2_z3": ["parallel=tp1pp2", Z3],
                                "pp2vpp2dp2_z2": ["parallel=tp1pp2vpp2", Z2]})
    for name, rows in runs.items():
        _assert_same(rows, reference, name)
