"""End to end through `run(cfg)`: every layout, schedule and DP size computes the tp1pp1 math (DESIGN.md §3).

Each job trains the tiny model (dropout 0, fp32, mock data) for a few steps on a persistent gloo pool
and writes metrics.jsonl; the test compares lm_loss (rel 1e-5) and grad_norm (rel 1e-4) step by step
with the single-process run, and reads layout.json for the facts that show the parallelism is real.

Tolerances (DESIGN.md §3): layouts change the summation order of TP all-reduces and of the DP
SUM, so fp32 results differ in the last bits; 1e-5 on the loss and 1e-4 on the norm per step.
"""

import json
from pathlib import Path

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job

# 2 steps: the first (the initial weights), and one after an update (each layout's optimizer step and its grad
# reduction feed the next forward); a layout that got a reduction wrong differs at step 2
STEPS = 2
BASE = ["model=tiny", f"train.train_iters={STEPS}", "train.eval_interval=null", "train.global_batch_size=8",
        "train.micro_batch_size=2"]


def _job(tmp: Path, name: str, world: int, overrides: list) -> list:
    run_dir = tmp / name
    run_distributed(run_job, world, BASE + overrides + [f"run.dir={run_dir}"], timeout_s=300)
    return read_rows(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return _job(tmp, "tp1pp1", 1, ["parallel=tp1pp1"])


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """``get(name, world, overrides) -> (rows, run_dir)``: each named job runs once per module (suite time:
    the tp2pp2 layout test and the layout-JSON test read the same run; each still runs it when alone)."""
    done = {}

    def get(name: str, world: int, overrides: list):
        if name not in done:
            tmp = tmp_path_factory.mktemp(name)
            done[name] = (_job(tmp, name, world, overrides), tmp / name)
        return done[name]

    return get


def _assert_same(rows, ref, *, loss_rel=1e-5, norm_rel=1e-4):
    assert [r["iteration"] for r in rows] == list(range(1, STEPS + 1))
    for r, q in zip(rows, ref):
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=loss_rel), (r["iteration"], r["lm_loss"], q["lm_loss"])
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=norm_rel), (r["iteration"], r["grad_norm"], q["grad_norm"])
        assert r["consumed_samples"] == q["consumed_samples"]
    # training moved: the loss of the last step is below the first
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]


LAYOUTS_4 = [
    ("tp2pp2", ["parallel=tp2pp2"]),
    ("tp2pp2_gpipe", ["parallel=tp2pp2", "schedule=gpipe"]),
    ("tp2pp1_dp2_sp", ["parallel=tp2pp1", "parallel.sequence_parallel=true"]),
    ("tp1pp4", ["parallel=tp1pp4"]),
    ("dp4_zero1_overlap", ["parallel=tp1pp1", "parallel.use_distributed_optimizer=true",
                           "parallel.overlap_grad_reduce=true", "parallel.bucket_size=5000"]),
    ("tp1pp2vpp2_dp2", ["parallel=tp1pp2vpp2"]),
]


@pytest.mark.parametrize("name,overrides", LAYOUTS_4, ids=[n for n, _ in LAYOUTS_4])
def test_layouts_on_4_processes_match_tp1pp1(layout_runs, reference, name, overrides):
    rows, _ = layout_runs(name, 4, overrides)
    _assert_same(rows, reference)


def test_tp2pp2_layout_json_shows_real_sharding(layout_runs, reference):
    rows, run_dir = layout_runs("tp2pp2", 4, dict(LAYOUTS_4)["tp2pp2"])
    _assert_same(rows, reference)
    layout = json.loads((run_dir / "layout.json").read_text())
    assert layout["world_size"] == 4
    ranks = layout["ranks"]
    assert [(r["tp"], r["pp"], r["dp"]) for r in ranks] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [r["layers"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    from mptrain.config.model import ModelConfig
    from mptrain.layers.params import count_parameters

    total = count_parameters(ModelConfig(), vocab_size=1000)
    assert sum(r["num_params"] for r in ranks) == total
    for r in ranks:  # each rank holds about a quarter (the embedding sits on the first stage)
        assert 0.15 * total < r["num_params"] < 0.4 * total, (r, total)


def test_tp2pp2vpp2_dp2_on_8_processes(tmp_path, reference):
    # the full 3-D layout end to end with the interleaved schedule; 1f1b and gpipe at tp2 x pp2 x dp2 (8 processes):
    # tests/test_schedules_gpt.py::test_gpt_tp2_pp2_dp2_world8 (every grad of the schedule's forward/backward), and
    # end to end here at tp2pp2 (1f1b, gpipe) and with DP beside PP (tp1pp2vpp2_dp2) on 4 processes
    rows = _job(tmp_path, "interleaved_1f1b", 8, ["parallel=tp2pp2vpp2", "schedule=interleaved_1f1b"])
    _assert_same(rows, reference)


@pytest.mark.parametrize("parallel", ["tp2pp1", "tp1pp2"])
def test_hsdp_zero3_with_tp_or_pp_on_8_processes(tmp_path, reference, parallel):
    """ZeRO-3 HSDP beside TP or PP: dp 4 = shards of 2 ranks, replicated twice (FSDP2's 2-D mesh over each model-
    parallel rank's DP group)."""
    rows = _job(tmp_path, f"{parallel}_hsdp", 8, [f"parallel={parallel}",
                                                   "parallel.data_parallel_sharding_strategy=optim_grads_params",
                                                   "parallel.data_parallel_shard_size=2"])
    _assert_same(rows, reference)
    log = (tmp_path / f"{parallel}_hsdp" / "train.log").read_text()
    assert "data-parallel: optim_grads_params (ZeRO-3, FSDP2, dp=4, HSDP shard 2 x replicate 2)" in log
