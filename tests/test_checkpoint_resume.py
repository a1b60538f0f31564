"""Checkpoint resume, end to end through `mptrain.training.run.run` (gloo pool) and real subprocesses.

- exact resume: train_iters=8 exit_interval=4 + resume to 8 == 8 straight iterations, bitwise
  (lm_loss, grad_norm, loss_scale, lr), fp32 with dropout (so the RNG restore matters) and fp16
  with a dynamic scaler, also when the resumed run gets another train.seed;
- resharding: saved at tp2pp2 (4 processes), resumed at tp1pp1 / tp2pp1 / tp1pp2 with a vocabulary
  that pads differently per tp: steps 5 and 6 match the tp2pp2 run (DESIGN.md §3 tolerances);
- non-finite grad injected in fp16: the step is skipped, the scale backs off, training goes on.
"""

from __future__ import annotations

import math

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job

SMALL = ["model=tiny", "model.num_layers=4", "model.hidden_size=32", "model.seq_length=16", "train.eval_interval=null",
         "train.global_batch_size=8", "train.micro_batch_size=2"]
# vocab 100 with d=64: V_pad 128 at tp1 and tp2 (rank 1 of tp2: 36 real rows); mock data over the same 100 ids
VOCAB = ["model.vocab_size=100", "model.make_vocab_size_divisible_by=64", "data.vocab_size=100"]
KEYS = ("lm_loss", "grad_norm", "loss_scale", "lr", "consumed_samples", "skipped_iter")


def _rows(run_dir) -> dict:
    return {r["iteration"]: r for r in read_rows(run_dir)}


def _pick(rows: dict, iterations) -> list:
    return [{k: rows[i][k] for k in KEYS} for i in iterations]


EXACT = {
    # fp32 with dropout: masks come from the restored RNG streams (a re-derived stream would differ)
    "fp32-dropout-tp1pp2": (2, ["parallel=tp1pp2", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]),
    # fp16: the scale grows every 2 good steps, so the scaler's trackers must cross the checkpoint intact
    "fp16-tp1pp1": (1, ["precision=fp16", "loss_scaler.initial_scale=65536", "loss_scaler.growth_interval=2"]),
}


@pytest.mark.parametrize("case", sorted(EXACT))
def test_exact_resume_bitwise(tmp_path, case):
    world, extra = EXACT[case]
    common = SMALL + extra + ["train.train_iters=8"]
    straight = tmp_path / "straight"
    run_distributed(run_job, world, common + [f"run.dir={straight}"])
    split, ckpt = tmp_path / "split", tmp_path / "ckpt"
    run_distributed(run_job, world, common + [f"run.dir={split}", f"checkpoint.save={ckpt}", "train.exit_interval=4"])
    assert (ckpt / "latest").read_text().strip() == "4"
    assert sorted(_rows(split)) == [1, 2, 3, 4]
    # the checkpoint, not the seed, restores the state: a different train.seed changes nothing
    run_distributed(run_job, world, common + [f"run.dir={split}", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}",
                                              "train.seed=999"])
    want, got = _rows(straight), _rows(split)
    assert sorted(got) == list(range(1, 9))
    assert _pick(got, range(1, 9)) == _pick(want, range(1, 9))  # bitwise: == on the floats read back from JSON
    assert (ckpt / "latest").read_text().strip() == "8"
    if case.startswith("fp16"):
        scales = [want[i]["loss_scale"] for i in range(1, 9)]
        assert len(set(scales)) > 1, scales  # the scaler state really crossed the checkpoint


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_reshard_resume_from_tp2pp2(tmp_path):
    # 6 iterations: the checkpoint of iteration 4, then two resumed steps (the second after an update at the new layout)
    common = SMALL + VOCAB + ["train.train_iters=6"]
    ref, ckpt = tmp_path / "tp2pp2", tmp_path / "ckpt"
    run_distributed(run_job, 4, common + ["parallel=tp2pp2", f"run.dir={ref}", f"checkpoint.save={ckpt}",
                                          "checkpoint.save_interval=4"])
    want = _rows(ref)
    for world, parallel in ((1, "tp1pp1"), (2, "tp2pp1"), (2, "tp1pp2")):
        run_dir = tmp_path / parallel
        run_distributed(run_job, world, common + [f"parallel={parallel}", f"run.dir={run_dir}", f"checkpoint.load={ckpt}",
                                                  "checkpoint.load_iteration=4"])
        got = _rows(run_dir)
        assert sorted(got) == [5, 6], parallel
        log = (run_dir / "train.log").read_text()
        assert "RNG states re-derived" in log and "saved at tp2 pp2 dp1" in log, log
        for i in (5, 6):
            # DESIGN.md §3: per-step loss rel 1e-5, grad norm rel 1e-4 across layouts (fp32 reduction order differs)
            assert _rel(got[i]["lm_loss"], want[i]["lm_loss"]) < 1e-5, (parallel, i, got[i], want[i])
            assert _rel(got[i]["grad_norm"], want[i]["grad_norm"]) < 1e-4, (parallel, i, got[i], want[i])
            assert got[i]["consumed_samples"] == want[i]["consumed_samples"] and got[i]["lr"] == want[i]["lr"]


@pytest.mark.parametrize("zero", [False, True])
def test_nonfinite_grad_on_one_dp_rank_skips_every_replica(tmp_path, zero):
    """dp2, bf16 (the folded optimizer step): poisoning rank 1 at iteration 3 skips that step on both
    data-parallel replicas, which then stay identical (same losses as a run poisoned on rank 0)."""
    runs = {}
    for poisoned in (0, 1):
        run_dir = tmp_path / f"p{poisoned}"
        run_distributed(run_job, 2, SMALL + ["parallel=tp1pp1", "precision=bf16", "train.train_iters=5",
                                             f"parallel.use_distributed_optimizer={str(zero).lower()}",
                                             f"run.dir={run_dir}", f"debug.nonfinite_grad_rank={poisoned}",
                                             "debug.nonfinite_grad_iteration=3"])
        runs[poisoned] = _rows(run_dir)
    for rows in runs.values():
        assert [rows[i]["skipped_iter"] for i in range(1, 6)] == [False, False, True, False, False]
        assert rows[5]["skipped_iters_total"] == 1 and rows[5]["nan_iters_total"] == 1
    assert [runs[0][i]["lm_loss"] for i in range(1, 6)] == [runs[1][i]["lm_loss"] for i in range(1, 6)]


def test_nonfinite_grad_fp16_skips_and_backs_off(tmp_path):
    run_dir = tmp_path / "run"
    # poison the last stage's grads (rank 1 of tp1pp2) at iteration 3; found_inf is MAX-reduced, so rank 0 skips too
    run_distributed(run_job, 2, SMALL + ["parallel=tp1pp2", "precision=fp16", "loss_scaler.initial_scale=1024",
                                         "loss_scaler.hysteresis=1", "train.train_iters=6", f"run.dir={run_dir}",
                                         "debug.nonfinite_grad_rank=1", "debug.nonfinite_grad_iteration=3"])
    rows = _rows(run_dir)
    assert sorted(rows) == list(range(1, 7))
    assert [rows[i]["skipped_iter"] for i in range(1, 7)] == [False, False, True, False, False, False]
    assert rows[3]["grad_norm"] is None and rows[3]["skipped_iters_total"] == 1 and rows[6]["skipped_iters_total"] == 1
    assert rows[2]["loss_scale"] == 1024.0 and rows[3]["loss_scale"] == 512.0  # backoff_factor 0.5, logged after the step
    assert all(math.isfinite(rows[i]["lm_loss"]) and rows[i]["grad_norm"] is not None for i in (4, 5, 6))
    assert rows[6]["lm_loss"] != rows[3]["lm_loss"]  # training went on
