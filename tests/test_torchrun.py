"""The user's commands as real processes: `torchrun ... train.py` and `python train.py`.

Each test starts real processes (gloo on CPU), with a wall-clock limit as a hang guard only: torchrun's workers
are forked with torch imported (tests/warm_python.py), and so is its agent (torch's own `torch.distributed.run`
served by the same shim, `warm_command`) except where the agent's work is the subject: the restart after a
SIGKILL keeps a fresh interpreter for its agent (so do Ctrl-C under the launcher and `make train ARGS="-m ..."`,
tests/test_quickstart.py; the two-node rendezvous, tests/test_e2e_multinode.py; the teardown after a worker's
exception, tests/test_checkpoint_faults.py). A 4-process
`parallel=tp2pp2` torchrun job equal to `python train.py parallel=tp1pp1`, layout and run folder included, is
tests/test_e2e_multinode.py's launch (two agents of 2 processes each).
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import run_distributed
from procs import run_python
from train_utils import read_rows, run_job, without_timing
from warm_python import warm_command, warm_env

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = ["model=tiny", "train.eval_interval=null", "train.global_batch_size=8", "train.micro_batch_size=2"]


def _run(cmd, timeout_s=240, fresh_agent=False):
    if cmd[:2] == [sys.executable, "train.py"]:  # `python train.py`: a real process forked with torch imported (procs.py)
        return run_python(cmd[1:], cwd=ROOT, env=ENV, timeout=timeout_s)
    # torchrun's workers served warm (tests/warm_python.py; suite time: ~4 s of imports each), and its agent too
    # unless ``fresh_agent`` (~1.7 CPU-s of imports)
    env = warm_env(ENV)
    return subprocess.run(cmd if fresh_agent else warm_command(cmd, env), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


SWEEP = [*TORCHRUN, "--nproc_per_node=2", "train.py", "-m", *TINY, "parallel=tp1pp1,tp2pp1,tp1pp2", "train.train_iters=3"]


def test_torchrun_layout_sweep_three_jobs_and_summary(launches):
    """`torchrun --nproc_per_node=2 train.py -m parallel=tp1pp1,tp2pp1,tp1pp2` → three job folders, equal losses, a summary."""
    out, _ = launches["sweep"]()
    root = launches.root / "sweep"
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = ["parallel=tp1pp1", "parallel=tp2pp1", "parallel=tp1pp2"]
    losses = [[r["lm_loss"] for r in read_rows(root / j)] for j in jobs]
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-5)
    summary = json.loads((root / "summary.json").read_text())
    assert len(summary["jobs"]) == 3 and all(j["status"] == "completed" for j in summary["jobs"])
    assert (root / "summary.md").exists()


LAUNCH = [sys.executable, "-m", "mptrain.launch", "--standalone"]
INVALID_CONFIG = [
    # world size 2 is not divisible by tp 4 × pp 1 (every other §5 combination is checked in-process
    # by tests/test_config.py; here: the exit code and the one line of a real torchrun job)
    ("torchrun", 2, ["parallel=tp4pp1"], "tensor_model_parallel_size"),
    # the README's quiet launcher: the one line is all of stderr
    ("launch", 2, ["parallel=tp4pp1"], "tensor_model_parallel_size"),
]


@pytest.mark.parametrize("launcher,nproc,overrides,key", INVALID_CONFIG)
def test_invalid_config_exits_1_with_one_line_in_all(launches, launcher, nproc, overrides, key):
    """A start-up config error is the same on every rank: rank 0 alone prints it (not one line per rank)."""
    out, elapsed = launches[f"invalid_config_{launcher}"]()
    run_dir = launches.root / f"invalid_config_{launcher}" / "r"
    assert elapsed < 60  # hang guard (the design asks for < 30 s on an idle machine)
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and key in errors[0], out.stderr[-2000:]
    # no Python traceback from our code (torchrun's own launcher prints its ChildFailedError report)
    assert "mptrain/" not in out.stderr and 'train.py", line' not in out.stderr
    if launcher == "launch":
        assert out.stderr.splitlines() == errors, out.stderr[-2000:]
    assert not run_dir.exists()  # nothing written before validation


# 6 iterations, a save every 2 (suite time: the checkpoint before the kill, one lost at it, one after the resume)
RESTART = [*TINY, "parallel=tp2pp1", "train.train_iters=6", "checkpoint.save_interval=2", "run.progress_bar=false"]


def test_sigkilled_worker_is_restarted_and_resumes_bitwise(tmp_path):
    """`torchrun --max-restarts=1 ... checkpoint.save=D checkpoint.load=D`: rank 1 SIGKILLs itself on the first
    attempt (mid-step at iteration 3; or while iter_0000004.tmp is being written); torchrun restarts both
    workers, they resume from D's newest complete checkpoint (2 in both cases) and finish with exit 0; the
    metrics rows equal an uninterrupted run's bitwise (fp32, dropout 0), one row per iteration. The mid-step
    case's agent is a fresh interpreter (the restart is the agent's work); the mid-save case's is served warm."""
    cases = (("forward", 3), ("save_write", 4))

    def launch(where, iteration):
        d, run_dir = tmp_path / f"D_{where}", tmp_path / f"r_{where}"
        return _run([*TORCHRUN, "--nproc_per_node=2", "--max-restarts=1", "train.py", *RESTART, f"run.dir={run_dir}",
                     f"checkpoint.save={d}", f"checkpoint.load={d}", "debug.fail_rank=1",
                     f"debug.fail_iteration={iteration}", f"debug.fail_where={where}", "debug.fail_kind=sigkill"],
                    fresh_agent=where == "forward")

    # suite time: the two jobs run side by side (each waits on its agent's restart and its workers' imports,
    # leaving a core idle); nothing here is timed
    with ThreadPoolExecutor(len(cases)) as pool:
        jobs = [pool.submit(launch, where, iteration) for where, iteration in cases]
        # the uninterrupted reference on the test pool's 2 gloo ranks (same code and world size as torchrun's
        # workers; one torchrun launch fewer for the suite's time)
        run_distributed(run_job, 2, [*RESTART, f"run.dir={tmp_path}/ref", f"checkpoint.save={tmp_path}/D_ref"])
        outs = [job.result() for job in jobs]
    strip = without_timing
    ref_rows = strip(read_rows(tmp_path / "ref"))
    for (where, _), out in zip(cases, outs):
        d, run_dir = tmp_path / f"D_{where}", tmp_path / f"r_{where}"
        assert out.returncode == 0, out.stderr[-3000:]
        assert "checkpoint: loaded iteration 2 " in out.stdout, out.stdout[-3000:]
        assert sorted(p.name for p in d.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]
        rows = strip(read_rows(run_dir))
        assert [r["iteration"] for r in rows] == list(range(1, 7))
        assert rows == ref_rows


def test_stalled_rank_ends_the_job_through_the_step_timeout(launches):
    """`train.step_timeout_s` after the first step: a rank that stalls makes its peers' collectives time out."""
    out, elapsed = launches["stalled_rank"]()
    assert out.returncode != 0
    assert elapsed < 60, elapsed  # the design's bound; the stall alone would last 120 s
    assert "job failed" in out.stderr  # rank 0's collective timed out and it exited at once
    # The stalled rank 1 ended itself (its heartbeat at 3 + 10 s, or the 10 s grace after torchrun's SIGTERM;
    # training/watchdog.py) instead of waiting for torchrun's SIGKILL 30 s after the SIGTERM.
    assert "error: rank 1: iteration 2 did not finish within 13 s" in out.stderr or (
        "error: signal 15 received but the step did not finish within 10 s" in out.stderr), out.stderr[-3000:]
    assert "forcefully exiting" not in out.stderr  # torchrun never escalated to SIGKILL


def test_stalled_step_ends_the_process_through_the_heartbeat(launches):
    """`python train.py` (world 1, so no collective can time out): a step stalled past `train.step_timeout_s` +
    max(10 s, train.step_timeout_s) ends the process with one line and exit 1 (training/watchdog.py)."""
    out, elapsed = launches["stalled_step"]()
    assert out.returncode == 1, out.stderr[-3000:]
    assert 11 <= elapsed < 60, elapsed  # the heartbeat's limit is 1 + 10 s; the stall alone would last 120 s
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 0: iteration 2 did not finish within 11 s (train.step_timeout_s=1); "
                      "a peer rank failed or stalled; exiting"], out.stderr[-3000:]
    assert [r["iteration"] for r in read_rows(launches.root / "stalled_step")] == [1]  # the first step ran unarmed


_SLOW_RANK0 = '''
import os, sys, time
sys.path.insert(0, {root!r})
import hydra
from mptrain.config.schema import register
import mptrain.checkpoint.atomic as atomic
import mptrain.training.step as step

register()
SLOW = float(os.environ["SLOW_S"])
RANK = int(os.environ["RANK"])
_publish, _evaluate, _train_step = atomic.publish, step.Trainer.evaluate, step.Trainer.train_step
calls = [0]


def publish(*a, **k):  # rank 0 publishes (and prunes) the checkpoint: slow storage
    time.sleep(SLOW)
    return _publish(*a, **k)


def evaluate(self, *a, **k):  # rank 0 slow at the start of an evaluation
    if RANK == 0:
        time.sleep(SLOW)
    return _evaluate(self, *a, **k)


def train_step(self, *a, **k):  # rank 1 stalls in step STALL_STEP (counted from 1 in this process)
    calls[0] += 1
    if RANK == 1 and calls[0] == int(os.environ.get("STALL_STEP", "0")):
        time.sleep(120)
    return _train_step(self, *a, **k)


atomic.publish, step.Trainer.evaluate, step.Trainer.train_step = publish, evaluate, train_step


@hydra.main(version_base="1.3", config_path={conf!r}, config_name="config")
def main(cfg):
    from mptrain.training.run import hydra_main
    return hydra_main(cfg)


main()
'''


def test_slow_evaluation_and_save_on_one_rank_are_not_timed_by_the_step_timeout(launches):
    """Evaluation and checkpoint saves run under train.timeout_s, not train.step_timeout_s (rank 0 3 s late in
    each at iteration 2, step timeout 1 s: both complete, the job goes on); the step timeout is back in force
    for the next steps (a rank stalled in step 4 ends the job). One run checks both (suite time)."""
    out, elapsed = launches["slow_rank0"]()
    tmp_path = launches.root / "slow_rank0"
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    # the slow evaluation and save at iteration 2 completed, and step 3 ran after them
    assert [(r["split"], r["iteration"]) for r in rows] == [
        ("valid", 0), ("train", 1), ("train", 2), ("valid", 2), ("train", 3)], out.stderr[-3000:]
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
    assert out.returncode != 0
    assert elapsed < 90  # the stall alone lasts 120 s
    assert "job failed" in out.stderr, out.stderr[-3000:]  # rank 0's collective timed out at 1 s


class _Launches(dict):
    root: Path


def _has_train_row(text: str, iteration: int) -> bool:
    """Whether metrics.jsonl ``text`` (its last line possibly still being written) holds train row ``iteration``."""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("split") == "train" and row.get("iteration") == iteration:
            return True
    return False


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches[name]()`` -> (CompletedProcess, elapsed_s) of this module's jobs that wait more than they compute,
    run side by side in threads (suite time: they ran one after another). Each job has its own folder under
    ``launches.root``; the commands, limits and hang guards are the ones the tests ran, and each job's elapsed time
    is measured from its own launch. Three phases, so that no timed step competes for the cores:

    1. the stalled-rank and stalled-step jobs start; once they recorded iteration 1 they only wait (a rank
       sleeping in step 2, its peer in a collective, until a timeout or a grace period);
    2. the slow-rank-0 job starts then: its steps 2-3 must each finish within its 1 s step timeout;
    3. once it recorded iteration 3 (from then on it only waits too), the layout sweep and the two invalid-config
       launches start (nothing in them is timed but a hang guard).
    """
    root = tmp_path_factory.mktemp("launches")
    slow = root / "slow_rank0"
    slow.mkdir()
    script = slow / "slow_rank0.py"
    script.write_text(_SLOW_RANK0.format(root=str(ROOT / "src"), conf=str(ROOT / "conf")))

    def timed(run):
        t0 = time.monotonic()
        out = run()
        return out, time.monotonic() - t0

    def slow_rank0():
        env = warm_env({**ENV, "SLOW_S": "3", "STALL_STEP": "4"})
        return subprocess.run(
            warm_command([*TORCHRUN, "--nproc_per_node=2", str(script), "model=tiny", "parallel=tp2pp1",
             "train.global_batch_size=8", "train.micro_batch_size=2", "train.train_iters=4",
             "train.eval_interval=2", "train.eval_iters=1", "train.step_timeout_s=1",
             f"checkpoint.save={slow}/ckpt", "checkpoint.save_interval=2", f"run.dir={slow}/r"], env),
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)

    def invalid_config(launcher, nproc, overrides):
        env = warm_env({**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), ENV.get("PYTHONPATH", "")])})
        cmd = TORCHRUN if launcher == "torchrun" else LAUNCH
        run_dir = root / f"invalid_config_{launcher}" / "r"
        return lambda: subprocess.run(warm_command([*cmd, f"--nproc_per_node={nproc}", "train.py", *TINY, *overrides,
                                                    f"run.dir={run_dir}"], env),
                                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)

    def after(rows: dict, run):
        """``run`` timed, once each job of ``rows`` ({name: (its metrics.jsonl, iteration)}) recorded that train
        iteration or ended."""
        def gated():
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                if all(futures[name].done() or (path.exists() and _has_train_row(path.read_text(), iteration))
                       for name, (path, iteration) in rows.items()):
                    break
                time.sleep(0.1)
            return timed(run)
        return gated

    stalled = {
        "stalled_rank": lambda: _run([*TORCHRUN, "--nproc_per_node=2", "train.py", *TINY, "parallel=tp2pp1",
                                      "train.train_iters=6", "train.step_timeout_s=3", "debug.sleep_rank=1",
                                      "debug.sleep_seconds=120", f"run.dir={root}/stalled_rank/r"], timeout_s=100),
        "stalled_step": lambda: _run([sys.executable, "train.py", *TINY, "parallel=tp1pp1", "train.train_iters=6",
                                      "train.step_timeout_s=1", "debug.sleep_rank=0", "debug.sleep_seconds=120",
                                      f"run.dir={root / 'stalled_step'}"], timeout_s=100),
    }
    untimed = {
        "sweep": lambda: _run([*SWEEP, f"run.dir={root / 'sweep'}"], timeout_s=360),
        **{f"invalid_config_{launcher}": invalid_config(launcher, nproc, overrides)
           for launcher, nproc, overrides, _ in INVALID_CONFIG},
    }
    with ThreadPoolExecutor(len(stalled) + 1 + len(untimed)) as pool:
        futures = {name: pool.submit(timed, run) for name, run in stalled.items()}
        futures["slow_rank0"] = pool.submit(after({"stalled_rank": (root / "stalled_rank" / "r" / "metrics.jsonl", 1),
                                                   "stalled_step": (root / "stalled_step" / "metrics.jsonl", 1)},
                                                  slow_rank0))
        for name, run in untimed.items():
            futures[name] = pool.submit(after({"slow_rank0": (slow / "r" / "metrics.jsonl", 3)}, run))
        out = _Launches({name: (lambda f=f: f.result()) for name, f in futures.items()})
        out.root = root
        yield out
