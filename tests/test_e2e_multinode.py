"""Beyond one machine, as far as one machine allows.

- Multi-node torchrun: two torchrun agents on localhost, each `--nnodes=2 --nproc_per_node=2`, meeting
  through the c10d rendezvous (no --node_rank), form one world of 4 that trains `parallel=tp2pp2`
  for 3 iterations equal to `python train.py parallel=tp1pp1` (DESIGN.md §3 tolerances), and writes its run
  folder (layout.json, config.yaml, train.log).
- SLURM: `read_dist_env` maps SLURM's variables (fake environ dicts; the node-list parser faked or
  submitit's), `hydra/launcher=mptrain_slurm` composes, and a sweep through Hydra's submitit
  launcher (its local executor: same plugin, same pickled task, no SLURM) writes one job folder
  per swept value and a summary. The plugin tests skip when hydra-submitit-launcher is missing
  (the optional `slurm` extra).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import run_python
from mptrain.errors import ConfigError
from mptrain.groups import DistEnv, read_dist_env, slurm_first_host
from train_utils import compose, read_rows
from warm_python import warm_command, warm_env

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = ["model=tiny", "train.eval_interval=null", "train.global_batch_size=8", "train.micro_batch_size=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- multi-node torchrun (c10d rendezvous) ------------------------------------------------------


def test_two_torchrun_nodes_c10d_rendezvous_tp2pp2_matches_tp1pp1(tmp_path):
    ref_dir, run_dir = tmp_path / "tp1pp1", tmp_path / "two_nodes"
    port = _free_port()
    node_cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=mptrain-test-{port}",
                "train.py", *TINY, "parallel=tp2pp2", "train.train_iters=3", f"run.dir={run_dir}"]
    # Two "nodes": identical commands; the c10d store is hosted by whichever agent binds the port first. Their
    # workers are served warm (tests/warm_python.py; suite time), and so is the second node's agent (torch's own
    # agent in a process forked with torch imported, ~1.7 CPU-s of imports fewer); the first node's agent is a
    # fresh interpreter.
    env = warm_env(ENV)
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (node_cmd, warm_command(node_cmd, env))]
    outputs = []
    try:
        deadline = time.monotonic() + 240  # hang guard only
        # the reference, `python train.py parallel=tp1pp1` (a child forked with torch imported, procs.py), while the
        # agents start (suite time: the agents' imports leave a core idle)
        ref_out = run_python(["train.py", *TINY, "parallel=tp1pp1", "train.train_iters=3", f"run.dir={ref_dir}"],
                             cwd=ROOT, env=ENV, timeout=180)
        for proc in nodes:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for proc in nodes:  # only the two agents this test started (their workers die with them)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert ref_out.returncode == 0, ref_out.stderr[-3000:]
    assert [p.returncode for p in nodes] == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)
    assert (run_dir / "config.yaml").exists() and (run_dir / "train.log").exists()
    layout = json.loads((run_dir / "layout.json").read_text())
    # one world of 4 = 2 agents x 2 workers (one agent alone could not make world 4 with nproc_per_node=2)
    assert layout["world_size"] == 4 and [r["rank"] for r in layout["ranks"]] == [0, 1, 2, 3]
    assert [r["layers"] for r in layout["ranks"]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    ref, rows = read_rows(ref_dir), read_rows(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for x, y in zip(ref, rows):  # DESIGN.md §3: TP/PP change fp32 summation order only
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


# --- SLURM environment mapping -------------------------------------------------------------------


def _never(nodelist):
    raise AssertionError(f"the node list {nodelist!r} should not be resolved here")


def test_torchrun_variables_win_over_slurm():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29400",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[1-2]"}
    got = read_dist_env(env, first_host=_never)
    assert got == DistEnv(rank=3, world_size=8, local_rank=1, master_addr="n0", master_port=29400, launcher="torchrun")
    assert got.init_method is None  # env:// (torchrun's agent store)


def test_no_launcher_is_a_world_of_one():
    assert read_dist_env({}, first_host=_never) == DistEnv(launcher="none")


def test_slurm_task_maps_procid_ntasks_localid_and_first_host():
    seen = []

    def first_host(nodelist):
        seen.append(nodelist)
        return "gpu003"

    env = {"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "gpu[003-004]"}
    got = read_dist_env(env, first_host=first_host)
    assert seen == ["gpu[003-004]"]
    # port: 20000 + 123456 mod 40000 = 20000 + 3456
    assert got == DistEnv(rank=13, world_size=16, local_rank=5, master_addr="gpu003", master_port=23456, launcher="slurm")
    assert got.init_method == "tcp://gpu003:23456"


def test_slurm_master_addr_and_port_from_the_environment_win():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "a,b", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "31000"}
    got = read_dist_env(env, first_host=_never)
    assert (got.rank, got.world_size, got.local_rank, got.master_addr, got.master_port) == (1, 2, 1, "10.0.0.1", 31000)


def test_slurm_port_default_without_job_id_and_single_task_needs_no_host():
    got = read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "x1"}, first_host=lambda n: n)
    assert (got.master_addr, got.master_port, got.local_rank) == ("x1", 29500, 0)
    one = read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "x1"}, first_host=_never)
    assert one.world_size == 1 and one.master_addr is None and one.init_method is None


def test_slurm_first_host_with_submitit_parser():
    pytest.importorskip("submitit")
    assert slurm_first_host("gpu[003-004,010],cpu1") == "gpu003"
    assert slurm_first_host("node7") == "node7"


def test_slurm_first_host_falls_back_to_scontrol(monkeypatch):
    import shutil

    monkeypatch.setitem(sys.modules, "submitit.slurm.slurm", None)  # the import raises ImportError
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="gpu003\ngpu004\n", stderr="")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/scontrol" if name == "scontrol" else None)
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert slurm_first_host("gpu[003-004]") == "gpu003"
    assert calls == [["scontrol", "show", "hostnames", "gpu[003-004]"]]


def test_slurm_without_parser_or_scontrol_is_a_one_line_config_error(monkeypatch):
    import shutil

    monkeypatch.setitem(sys.modules, "submitit.slurm.slurm", None)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="MASTER_ADDR") as err:
        read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[1-2]"})
    assert "\n" not in str(err.value)


# --- Hydra's submitit launcher --------------------------------------------------------------------


def test_mptrain_slurm_launcher_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher (the slurm extra)")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mptrain.config.schema import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", return_hydra_config=True,
                            overrides=["hydra/launcher=mptrain_slurm", "hydra.launcher.nodes=2", "parallel=tp2pp4"])
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)  # one task per GPU
    assert launcher.timeout_min == 240 and launcher.max_num_timeout == 0
    assert cfg.parallel.tensor_model_parallel_size == 2  # the job config is untouched
    assert compose(["parallel=tp2pp4"]).parallel.pipeline_model_parallel_size == 4


def test_sweep_through_the_submitit_launcher_writes_job_folders_and_summary(tmp_path):
    """`train.py -m hydra/launcher=submitit_local ...`: each job runs in a submitit process (sys.argv is submitit's)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher (the slurm extra)")
    root = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=submitit_local", *TINY, "model.num_layers=2",
           "model.seq_length=16", "train.train_iters=2", "train.seed=1,2", f"run.dir={root}"]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    assert [(j["dir"], j["status"]) for j in summary["jobs"]] == [("train.seed=1", "completed"), ("train.seed=2", "completed")]
    for job in summary["jobs"]:
        rows = read_rows(root / job["dir"])
        assert [r["iteration"] for r in rows] == [1, 2]
        assert job["final_loss"] == rows[-1]["lm_loss"]  # the JobResult came back from the submitit process
    first = [[r["lm_loss"] for r in read_rows(root / d)] for d in ("train.seed=1", "train.seed=2")]
    assert first[0][0] != first[1][0]  # different init seeds: the swept value reached each job
