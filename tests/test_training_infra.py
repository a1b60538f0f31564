"""layout.json gather (world 4), FLOP formula (gpt_1.3b worked example), timers, sweep policy (loggers: test_loggers.py)."""

import json
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from harness import run_distributed
from procs import run_python
from mptrain.config.model import ModelConfig
from mptrain.errors import ConfigError
from mptrain.groups import build_groups
from mptrain.layers.params import flops_per_iteration, matmul_weights
from mptrain.training.layout import (
    IterationCounters,
    RankFacts,
    gather_and_write_layout,
    optimizer_state_bytes,
)
from mptrain.runs.summary import JobResult, SweepJob, eval_summary, read_summary, record_job, start_sweep
from mptrain.runs.sweep import plan_sweep, sweep_job_of, sweep_root, swept_keys
from mptrain.training.throughput import (
    StartupClock,
    peak_tflops_per_gpu,
    throughput,
)
from mptrain.training.timers import Timers

REPO = Path(__file__).resolve().parents[1]


# --- layout.json --------------------------------------------------------------------------------
def _layout_world4(rank, world_size, run_dir):
    groups = build_groups(2, 2)
    try:
        counters = IterationCounters()
        for it in range(2):  # two iterations with different counts: layout.json holds their average
            counters.add_bytes_sent("pp", 100 * (rank + 1) * (1 + 2 * it))  # 1×, 3× → average 2×
            counters.add_bytes_sent("tp", 10)
            if groups.tp_rank == 0 and (groups.is_first_stage or groups.is_last_stage):
                counters.add_samples_read(8)
            counters.note_inflight(2 - groups.pp_rank)
            counters.end_iteration()
        facts = RankFacts.build(
            groups,
            layers=[0, 1] if groups.pp_rank == 0 else [3, 2],
            num_params=1000 + rank,
            param_dtype=torch.float16,
            main_param_dtype=torch.float32,
            optimizer_state_bytes=8 * (1000 + rank),
            schedule="1f1b",
            counters=counters,
            data_parallel_sharding_strategy="optim",
            param_bytes=2 * (1000 + rank),
            grad_bytes=4 * (1000 + rank),
        )
        return gather_and_write_layout(run_dir, facts, rank=rank, world_size=world_size)
    finally:
        groups.destroy()


def test_layout_gathered_to_rank0_world4_tp2pp2(tmp_path):
    out = run_distributed(_layout_world4, 4, str(tmp_path))
    assert out[1:] == [None, None, None]
    layout = json.loads((tmp_path / "layout.json").read_text())
    assert layout == out[0]
    assert layout["world_size"] == 4
    # rank = tp + 2·pp (dp = 1): rank 0 (tp0,pp0), 1 (tp1,pp0), 2 (tp0,pp1), 3 (tp1,pp1)
    expected = []
    for r in range(4):
        expected.append({
            "rank": r, "tp": r % 2, "pp": r // 2, "dp": 0, "cp": 0, "vpp": None,
            "layers": [0, 1] if r < 2 else [2, 3], "num_params": 1000 + r,
            "param_dtype": "float16", "main_param_dtype": "float32", "optimizer_state_bytes": 8 * (1000 + r),
            "schedule": "1f1b", "max_inflight_microbatches": 2 - r // 2,
            "bytes_sent": {"tp": 10, "pp": 200 * (r + 1), "dp": 0, "embedding": 0},
            "samples_read": 8 if r % 2 == 0 else 0,
            "data_parallel_sharding_strategy": "optim", "param_bytes": 2 * (1000 + r), "grad_bytes": 4 * (1000 + r),
        })
    assert layout["ranks"] == expected
    assert list(layout["ranks"][0]) == list(expected[0])  # key order of DESIGN.md §2


def test_optimizer_state_bytes_adam():
    p = torch.nn.Parameter(torch.zeros(10, 3))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    # exp_avg + exp_avg_sq: 2 × 30 fp32 elements; `step` is a 0-dim fp32 tensor (4 bytes)
    assert optimizer_state_bytes(opt) == 2 * 30 * 4 + 4


# --- throughput ---------------------------------------------------------------------------------
def test_flop_formula_gpt_1p3b_worked_example():
    # gpt_1.3b: L=24, h=2048, V=50257 padded to 50304 (multiple of 128 × tp 1), s=2048, global batch 8.
    L, h, s, v_pad, T = 24, 2048, 2048, 50304, 8 * 2048
    m = ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=16, seq_length=s)
    assert matmul_weights(m, padded_vocab_size=v_pad) == 1_310_982_144  # 12·24·2048² + 50304·2048
    F = flops_per_iteration(m, padded_vocab_size=v_pad, tokens_per_iteration=T)
    assert F == 148_665_997_983_744  # 6·N·T + 12·L·h·s·T, exact integers
    # Same as Megatron's closed form 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)); rel 1e-12: float64 rounding only
    assert F == pytest.approx(72 * 8 * s * L * h**2 * (1 + s / (6 * h) + v_pad / (12 * L * h)), rel=1e-12)
    r = throughput(flops=F, tokens=T, elapsed_s=2.0, num_gpus=8, peak_tflops=989.0)
    assert r.tokens_per_s == 8192.0 and r.tokens_per_s_per_gpu == 1024.0
    assert r.tflops_per_gpu == pytest.approx(F / 2.0 / 8 / 1e12, rel=1e-15)  # same float ops, reordered at most
    assert r.mfu == pytest.approx(9.291624873984 / 989.0, rel=1e-12)
    assert throughput(flops=F, tokens=T, elapsed_s=2.0, num_gpus=8, peak_tflops=None).mfu is None


def test_peak_and_memory_on_cpu():
    assert peak_tflops_per_gpu(torch.device("cpu")) is None
    assert peak_tflops_per_gpu(torch.device("cpu"), override=100.0) == 100.0
    clock = StartupClock(t0=time.time() - 5.0)
    assert clock.mark("init") >= 5.0
    assert list(clock.as_dict()) == ["init_s"]
    with pytest.raises(ValueError):
        throughput(flops=1.0, tokens=1, elapsed_s=0.0, num_gpus=1, peak_tflops=None)


# --- timers -------------------------------------------------------------------------------------
def test_timers_levels_accumulate_and_reset():
    assert Timers(log_level=0).empty  # level 0: no timer runs, the trainer prints no timer line
    timers = Timers(log_level=1)
    assert timers.empty
    for _ in range(2):
        with timers("optimizer"):
            time.sleep(0.01)
    timers("interval-time", 2).start()  # level 2 > 1: a no-op
    timers("interval-time", 2).stop()
    elapsed = timers.elapsed_s(reset=False)
    assert list(elapsed) == ["optimizer"] and not timers.empty
    assert elapsed["optimizer"] >= 0.02  # lower bound from the sleeps (not a speed assertion)
    line = timers.report(normalizer=2)
    assert line.startswith("times (ms): optimizer ") and "interval-time" not in line
    assert float(line.split()[-1]) >= 10.0  # ms per iteration, ≥ the 10 ms sleep
    assert timers.elapsed_s()["optimizer"] == 0.0  # report reset it
    t = timers("forward-backward")
    t.start()
    with pytest.raises(RuntimeError, match="started twice"):
        t.start()


# --- sweeps -------------------------------------------------------------------------------------
def _job_hydra_config(overrides):
    """The `hydra` node Hydra composes for one sweep job with `overrides` (the sweep plan's hydra overrides first;
    the job number is the launcher's)."""
    from hydra import compose, initialize_config_dir

    from mptrain.config.schema import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=["hydra.mode=MULTIRUN", "hydra.job.num=0", *overrides], return_hydra_config=True).hydra


def test_the_sweep_plan_names_each_job_folder_through_hydra():
    """The sweep's own overrides (Hydra's `hydra.overrides.task`, sweeps unexpanded) give the swept keys; the plan's
    hydra overrides make Hydra name each job's folder by them (`hydra.job.override_dirname`) under the root."""
    task = ["model=tiny", "parallel=tp1pp1,tp2pp1", "precision=choice(fp32,bf16)", "train.train_iters=3", "run.dir=S"]
    assert swept_keys(task) == ["parallel", "precision"]
    assert swept_keys(["model=tiny"], {"optim.lr": "1e-3,3e-4"}) == ["optim.lr"]
    with pytest.raises(ConfigError, match="run.dir cannot be swept"):
        swept_keys(["run.dir=a,b"])
    plan = plan_sweep(task, run_dir="S")
    assert (plan.root, plan.unswept, plan.move_line) == ("S", ("model", "run.dir", "train.train_iters"), None)
    job = sweep_job_of(_job_hydra_config([*plan.hydra_overrides, "model=tiny", "precision=bf16", "parallel=tp2pp1",
                                          "train.train_iters=3", "run.dir=S"]))
    assert (job.root, job.subdir, job.swept) == ("S", "parallel=tp2pp1,precision=bf16", ("parallel", "precision"))
    assert job.dir == Path("S/parallel=tp2pp1,precision=bf16")
    plan = plan_sweep(["checkpoint.save=a/b,c/d", "model=tiny"], run_dir="my sweeps/it's")
    job = sweep_job_of(_job_hydra_config([*plan.hydra_overrides, "checkpoint.save=a/b", "model=tiny"]))
    assert (job.root, job.subdir) == ("my sweeps/it's", "checkpoint.save=a_b")  # quoted root; `/` in a value: one folder


def test_a_sweep_root_the_config_names_gives_way_when_it_holds_anything(tmp_path, monkeypatch):
    """`run.dir` from the command line is the root as is (a second sweep appends); the config's root (or
    outputs/multirun) gives way to `<root>-N` when it holds a run or an earlier sweep, not Hydra's own file."""
    monkeypatch.chdir(tmp_path)
    assert sweep_root(None, explicit=False) == "outputs/multirun"
    (tmp_path / "outputs" / "multirun").mkdir(parents=True)
    (tmp_path / "outputs" / "multirun" / "multirun.yaml").write_text("x: 1\n")  # another rank's sweeper, just now
    assert sweep_root(None, explicit=False) == "outputs/multirun"
    (tmp_path / "outputs" / "multirun" / "summary.json").write_text("{}")
    assert plan_sweep(["train.seed=1,2"], run_dir=None).move_line == (
        "sweep: outputs/multirun holds an earlier sweep; this sweep writes to outputs/multirun-2 (pick the folder with "
        "run.dir=)")
    (tmp_path / "R").mkdir()
    (tmp_path / "R" / "config.yaml").write_text("x: 1\n")
    assert sweep_root("R", explicit=False) == "R-2" and sweep_root("R", explicit=True) == "R"
    assert plan_sweep(["train.seed=1,2"], run_dir="R").move_line == (
        "sweep: R holds a run; this sweep writes to R-2 (pick the folder with run.dir=)")
    assert plan_sweep(["train.seed=1,2", "run.dir=R"], run_dir="R").root == "R"


def test_record_job_writes_summary_json_and_md(tmp_path):
    def job(num, value):
        return SweepJob(root=str(tmp_path), subdir=f"parallel={value}", num=num,
                        overrides=(f"parallel={value}", "train.train_iters=3"), swept=("parallel",))

    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
              "virtual_pipeline_model_parallel_size": None, "num_microbatches": 4, "schedule": "no_pipelining"}
    record_job(job(0, "tp2pp1"), status="completed",
               result=JobResult(layout=layout, tokens_per_s_per_gpu=123.4, final_loss=6.5))
    record_job(job(1, "tp8pp1"), status="rejected", message="parallel: world size 2 is not divisible by ... = 8")
    summary = read_summary(tmp_path)
    assert [(j["job"], j["dir"], j["status"]) for j in summary["jobs"]] == [(0, "parallel=tp2pp1", "completed"),
                                                                            (1, "parallel=tp8pp1", "rejected")]
    assert summary["jobs"][0]["swept"] == {"parallel": "tp2pp1"}
    assert summary["jobs"][0]["overrides"] == ["parallel=tp2pp1", "train.train_iters=3"]
    assert (summary["completed"], summary["rejected"], summary["failed"]) == (1, 1, 0)
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[4] == "| 0 | `parallel=tp2pp1` | tp2 pp1 dp1, 4 mb, no_pipelining | 123.4 | - | - | 6.5000 | - | - | completed |"
    assert md[5].startswith("| 1 | `parallel=tp8pp1` | - |") and "rejected: parallel: world size 2" in md[5]
    assert md[-1] == "2 jobs: 1 completed, 1 rejected, 0 failed."


def test_summary_has_final_and_best_validation_loss_and_ppl(tmp_path):
    rows = [{"split": "valid", "iteration": 0, "lm_loss": 5.5, "ppl": 244.7},
            {"split": "train", "iteration": 1, "lm_loss": 5.0},
            {"split": "valid", "iteration": 10, "lm_loss": 2.5, "ppl": 12.18},
            {"split": "valid", "iteration": 20, "lm_loss": None, "ppl": None},  # diverged: null
            {"split": "valid", "iteration": 30, "lm_loss": 2.75, "ppl": 15.64},
            {"split": "test", "iteration": 30, "lm_loss": 1.0, "ppl": 2.7}]
    ev = eval_summary(rows)
    assert ev == {"final_valid_loss": 2.75, "final_valid_ppl": 15.64, "best_valid_loss": 2.5, "best_valid_ppl": 12.18,
                  "best_valid_iteration": 10}
    assert set(eval_summary([{"split": "train", "iteration": 1, "lm_loss": 1.0}]).values()) == {None}
    job = SweepJob(root=str(tmp_path), subdir="optim.lr=0.001", num=0, overrides=("optim.lr=0.001",), swept=("optim.lr",))
    record_job(job, status="completed", result=JobResult(final_loss=2.6, **ev))
    assert read_summary(tmp_path)["jobs"][0]["best_valid_iteration"] == 10
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[2] == ("| job | swept | layout | tokens/s/GPU | MFU | peak mem (GiB) | last train loss | final valid loss (ppl) "
                     "| best valid loss (ppl) @ iter | status |")
    assert md[4] == "| 0 | `optim.lr=0.001` | - | - | - | - | 2.6000 | 2.7500 (15.64) | 2.5000 (12.18) @ 10 | completed |"


def test_a_second_sweep_into_the_same_root_appends_job_numbers(tmp_path):
    def job(num, lr):
        return SweepJob(root=str(tmp_path), subdir=f"optim.lr={lr}", num=num, overrides=(f"optim.lr={lr}",),
                        swept=("optim.lr",))

    assert start_sweep(tmp_path) == 0 and not (tmp_path / "summary.json").exists()  # an empty root: nothing written
    record_job(job(0, 1), status="completed")
    record_job(job(1, 2), status="completed")
    assert start_sweep(tmp_path) == 2  # the second sweep: Hydra numbers its jobs 0, 1 again
    record_job(job(0, 1), status="rejected", message="run.dir holds a run")
    record_job(job(1, 3), status="completed")
    record_job(job(1, 3), status="completed")  # the same job recorded again replaces its own entry only
    jobs = read_summary(tmp_path)["jobs"]
    assert [(j["job"], j["dir"], j["status"]) for j in jobs] == [
        (0, "optim.lr=1", "completed"), (1, "optim.lr=2", "completed"), (2, "optim.lr=1", "rejected"),
        (3, "optim.lr=3", "completed")]
    assert (tmp_path / "summary.md").read_text().splitlines()[-1] == "4 jobs: 3 completed, 1 rejected, 0 failed."


# A stand-in task using this module's pieces the way `run(cfg)` does (world size fixed at 2 for validation).
APP = textwrap.dedent('''
    import dataclasses, hydra, torch
    from mptrain.config.schema import register
    register()

    @hydra.main(version_base="1.3", config_path={conf!r}, config_name="config")
    def main(cfg):
        from mptrain.training.validate import validate_config
        from mptrain.training.layout import IterationCounters, RankFacts, gather_and_write_layout
        from mptrain.training.metrics import MetricsWriter, TrainRow
        from mptrain.runs.claim import claim_run_dir
        from mptrain.runs.folder import planned_config
        from mptrain.runs.summary import JobResult
        from mptrain.runs.sweep import current_sweep_job
        cfg, plan = planned_config(cfg, sweep_job=current_sweep_job())
        derived = validate_config(cfg, 2)
        if cfg.train.seed == 99:
            raise RuntimeError("injected runtime failure")
        run_dir = claim_run_dir(cfg, plan, rank=0, world_size=1)
        with MetricsWriter(run_dir, 0, progress_bar=False) as w:
            w.write_train(TrainRow(1, 8, 5.0, 1e-3, 1.0, 1.0, False, 0, 0, 8, derived.num_microbatches, 10.0, None, None, None))
        facts = RankFacts(0, 0, 0, 0, None, [0, 1, 2, 3], 10, "float32", None, 0, derived.schedule, 1, {{}}, 8)
        gather_and_write_layout(run_dir, facts, rank=0, world_size=1)
        return JobResult(layout=dataclasses.asdict(derived), final_loss=5.0, run_dir=str(run_dir))

    main()
''')


def _run_app(tmp_path, *args):
    app = tmp_path / "app.py"
    app.write_text(APP.format(conf=str(REPO / "conf")))
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    proc = run_python([str(app), *args], cwd=work, timeout=300,  # a real child process, forked with torch imported
                      env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")})  # this checkout
    return proc, work


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_single_run_writes_nothing_outside_run_dir(tmp_path):
    proc, work = _run_app(tmp_path, "run.dir=R")
    assert proc.returncode == 0, proc.stderr
    assert _tree(work) == ["R", "R/config.yaml", "R/layout.json", "R/metrics.jsonl", "R/train.log"]


def test_sweep_rejected_job_recorded_sweep_goes_on_and_ends_non_zero(tmp_path):
    proc, work = _run_app(tmp_path, "-m", "parallel=tp1pp1,tp8pp1,tp2pp1", "train.train_iters=3", "run.dir=S")
    assert proc.returncode == 1, proc.stderr
    tree = _tree(work)
    assert [p for p in tree if "/" not in p[2:]] == ["S", "S/multirun.yaml", "S/parallel=tp1pp1", "S/parallel=tp2pp1",
                                                     "S/summary.json", "S/summary.md"]
    assert "S/parallel=tp2pp1/metrics.jsonl" in tree and "S/parallel=tp8pp1" not in tree
    summary = json.loads((work / "S" / "summary.json").read_text())
    assert [(j["dir"], j["status"]) for j in summary["jobs"]] == [
        ("parallel=tp1pp1", "completed"), ("parallel=tp8pp1", "rejected"), ("parallel=tp2pp1", "completed")]
    assert summary["jobs"][2]["layout"]["tensor_model_parallel_size"] == 2 and summary["jobs"][2]["final_loss"] == 5.0
    assert "world size 2 is not divisible by tensor_model_parallel_size × pipeline_model_parallel_size" in summary["jobs"][1]["message"]
    assert "sweep: 1 of 3 jobs rejected by validation" in proc.stderr


def test_sweep_rerun_into_the_same_root_appends_new_job_numbers(tmp_path):
    proc, work = _run_app(tmp_path, "-m", "train.seed=1,2", "train.train_iters=3", "run.dir=S")
    assert proc.returncode == 0, proc.stderr
    proc, work = _run_app(tmp_path, "-m", "train.seed=2,3", "train.train_iters=3", "run.dir=S")
    assert proc.returncode == 1  # train.seed=2's folder already holds a run: that job is rejected
    summary = json.loads((work / "S" / "summary.json").read_text())
    assert [(j["job"], j["dir"], j["status"]) for j in summary["jobs"]] == [
        (0, "train.seed=1", "completed"), (1, "train.seed=2", "completed"), (2, "train.seed=2", "rejected"),
        (3, "train.seed=3", "completed")]
    assert "sweep job 2 (train.seed=2) rejected" in proc.stderr


def test_a_sweep_without_run_dir_gets_a_fresh_root_and_run_dir_is_the_job_folder(tmp_path):
    """No run.dir: the first sweep writes to outputs/multirun, the second to outputs/multirun-2 (one line
    says so), and `${run.dir}` in each job's config.yaml is that job's own folder."""
    args = ("-m", "train.seed=1,2", "train.train_iters=3", "checkpoint.save=${run.dir}/ck")
    proc, work = _run_app(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    proc, work = _run_app(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    assert ("sweep: outputs/multirun holds an earlier sweep; this sweep writes to outputs/multirun-2 "
            "(pick the folder with run.dir=)") in proc.stderr.splitlines()
    for root in ("multirun", "multirun-2"):
        summary = json.loads((work / "outputs" / root / "summary.json").read_text())
        assert [(j["job"], j["dir"], j["status"]) for j in summary["jobs"]] == [
            (0, "train.seed=1", "completed"), (1, "train.seed=2", "completed")]
        saved = yaml.safe_load((work / "outputs" / root / "train.seed=2" / "config.yaml").read_text())
        assert saved["run"]["dir"] == str(work / "outputs" / root / "train.seed=2")
        assert saved["checkpoint"]["save"] == f"outputs/{root}/train.seed=2/ck"
    assert sorted(p.name for p in (work / "outputs").iterdir()) == ["multirun", "multirun-2"]


@pytest.mark.parametrize("multirun", [["-m"], ["hydra.mode=MULTIRUN"]], ids=["-m", "hydra.mode"])
def test_a_sweep_into_the_configs_run_folder_holding_a_run_moves_on(tmp_path, multirun):
    """`make train ARGS="-m ..."` or `ARGS="hydra.mode=MULTIRUN ..."`: the experiment's run.dir holds a run, so the
    sweep goes to `<dir>-2` as a single run would (one line says so); the run there is untouched."""
    taken = tmp_path / "work" / "outputs" / "shakespeare_cpu"
    taken.mkdir(parents=True)
    (taken / "config.yaml").write_text("x: 1\n")
    (taken / "metrics.jsonl").write_text('{"split": "train", "iteration": 1}\n')
    proc, work = _run_app(tmp_path, *multirun, "experiment=shakespeare_cpu", "parallel=tp2pp1", "train.seed=1,2",
                          "train.train_iters=3")
    assert proc.returncode == 0, proc.stderr
    assert ("sweep: outputs/shakespeare_cpu holds a run; this sweep writes to outputs/shakespeare_cpu-2 (pick the "
            "folder with run.dir=)") in proc.stderr.splitlines()
    assert sorted(p.name for p in taken.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert (taken / "metrics.jsonl").read_text() == '{"split": "train", "iteration": 1}\n'
    root = work / "outputs" / "shakespeare_cpu-2"
    summary = json.loads((root / "summary.json").read_text())
    assert [(j["dir"], j["status"]) for j in summary["jobs"]] == [("train.seed=1", "completed"),
                                                                  ("train.seed=2", "completed")]
    saved = yaml.safe_load((root / "train.seed=2" / "config.yaml").read_text())
    assert saved["checkpoint"]["save"] == "outputs/shakespeare_cpu-2/train.seed=2/checkpoints"


def test_sweep_runtime_failure_aborts(tmp_path):
    proc, work = _run_app(tmp_path, "-m", "train.seed=1,99,2", "run.dir=S")
    assert proc.returncode == 1
    summary = json.loads((work / "S" / "summary.json").read_text())
    assert [(j["dir"], j["status"]) for j in summary["jobs"]] == [("train.seed=1", "completed"), ("train.seed=99", "failed")]
    assert summary["jobs"][1]["message"] == "RuntimeError: injected runtime failure"
    assert not (work / "S" / "train.seed=2").exists()  # the sweep stopped
    assert "injected runtime failure" in proc.stderr
