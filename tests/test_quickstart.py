"""The newcomer's path: the quick-start job saves a checkpoint that generate, export and transformers then
use as written; Ctrl-C is one line and exit 130; consecutive runs never collide on a folder named by the
config; a refusal under the launcher is one line; `make train ARGS="-m ..."` sweeps.

The quick start runs `make train`'s job (experiment=shakespeare_cpu, tp2 x pp2 on 4 ranks, defaults for
every path) on the gloo pool in an empty folder, with fewer iterations; the follow-ups call the tools'
`main(ARGS)` with the command lines the README gives. The launcher tests are real `python -m mptrain.launch`
processes (the signal and the exit code are what they check); the launcher is a fresh interpreter under Ctrl-C,
and served warm (tests/warm_python.py `warm_command`) for the run folder's one line and `make train`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from procs import start_python
from train_utils import read_rows, run_job
from warm_python import warm_command, warm_env

REPO = Path(__file__).resolve().parents[1]
# 10 iterations (suite time): what follows needs a checkpoint the tools read, not a trained model; there greedy
# decoding already has clear top-1 choices (the tie check below) and a completion that is not all whitespace
QUICK_START = ["experiment=shakespeare_cpu", "train.train_iters=10", "train.eval_interval=null"]
GENERATE = ["--checkpoint", "outputs/shakespeare_cpu/checkpoints", "--prompt", "ROMEO:", "--max-new-tokens", "100"]
EXPORT = ["--checkpoint", "outputs/shakespeare_cpu/checkpoints", "--format", "hf-gpt2", "--output", "outputs/shakespeare_hf"]
TINY = ["model=tiny", "parallel=tp2pp1", "train.eval_interval=null"]


def _in(cwd: str, fn, *args):
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return fn(*args)
    finally:
        os.chdir(old)


def _train_task(rank: int, world: int, cwd: str, overrides: list):
    return _in(cwd, run_job, rank, world, overrides)


def _generate_task(rank: int, world: int, cwd: str, argv: list) -> tuple:
    from mptrain.generate import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = _in(cwd, main, argv)
    return code, buf.getvalue()


def test_quick_start_checkpoint_feeds_generate_export_and_transformers(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from mptrain.checkpoint.offline import load_consolidated
    from mptrain.export import main as export

    run_distributed(_train_task, 4, str(tmp_path), QUICK_START, timeout_s=600)
    ckpt = tmp_path / "outputs" / "shakespeare_cpu" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "10"
    assert [r["iteration"] for r in read_rows(tmp_path / "outputs" / "shakespeare_cpu")] == list(range(1, 11))

    (code, text), = run_distributed(_generate_task, 1, str(tmp_path), GENERATE)
    (code_json, raw), = run_distributed(_generate_task, 1, str(tmp_path), GENERATE + ["--json"])
    assert code == code_json == 0
    out = json.loads(raw)
    assert text == out["text"] + "\n" and text.startswith("ROMEO:")  # greedy: the same text each run
    assert len(out["new_ids"]) == 100 and out["completion"].strip()

    monkeypatch.chdir(tmp_path)
    assert export(EXPORT) == 0
    assert export(["--checkpoint", "outputs/shakespeare_cpu/checkpoints", "--output", "st"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained("outputs/shakespeare_hf").eval()
    ours = load_consolidated("st").eval()
    ids = torch.tensor([out["prompt_ids"] + out["new_ids"]])
    vocab = hf.config.vocab_size
    with torch.no_grad():
        want = ours(ids, torch.arange(ids.shape[1])[None])[..., :vocab]
        got = hf(ids).logits
    # fp32, same math; HF's attention kernel sums in another order than SDPA: 1e-4 absolute on O(1) logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # generate's tokens are transformers' greedy choices (where the top two are not a near tie)
    n = len(out["prompt_ids"])
    top2 = got[0, n - 1:-1].topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > 1e-3
    assert clear.sum() > 50
    assert torch.equal(top2.indices[clear, 0], torch.tensor(out["new_ids"])[clear])


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return warm_env(env)  # torchrun's workers served warm (tests/warm_python.py; suite time)


def _launch(nproc: int, overrides: list, cwd: Path) -> list:
    return [sys.executable, "-m", "mptrain.launch", "--standalone", f"--nproc_per_node={nproc}", "-m", "mptrain.train",
            *overrides]


def _wait_for_rows(proc, run_dir: Path, rows: int, stderr) -> None:
    """Wait until ``run_dir`` holds ``rows`` metrics rows (``proc`` still running; ``stderr()``: its stderr so far)."""
    deadline = time.monotonic() + 300  # hang guard only
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None, stderr()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _interrupt_after_rows(cmd: list, cwd: Path, run_dir: Path, rows: int = 3) -> tuple:
    """Start `cmd` in its own process group, wait for `rows` metrics rows, send SIGINT to the group (as a
    terminal's Ctrl-C does: the launcher and every worker get it); (exit code, stderr) once it ended."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_for_rows(proc, run_dir, rows, lambda: proc.stderr.read())
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def _interrupt_python_after_rows(args: list, cwd: Path, run_dir: Path, rows: int = 3) -> tuple:
    """`python ARGS` (one process: Ctrl-C reaches it alone) forked with torch imported (procs.py; suite time: the
    trainer's SIGINT handling, not interpreter start-up, is what it is about; a fresh interpreter under Ctrl-C is
    the launcher test's), SIGINT after `rows` metrics rows; (exit code, stderr) once it ended."""
    proc = start_python(args, cwd=cwd, env=_env())
    try:
        _wait_for_rows(proc, run_dir, rows, proc.stderr_text)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, proc.stderr_text()


@pytest.fixture(scope="module")
def launcher_jobs(tmp_path_factory):
    """``launcher_jobs[name]()`` -> (folder, what the job returned) for the three real-process tests below, run side
    by side in threads (suite time: each is mostly fresh interpreters importing torch, and a launcher's agent
    imports on one core while the other idles; they ran one after another). Each job has its own folder, and the
    commands and hang guards are the ones the tests ran."""
    root = tmp_path_factory.mktemp("launcher_jobs")
    folders = {name: root / name for name in ("ctrl_c_launcher", "ctrl_c_train_py", "fresh_run")}
    for folder in folders.values():
        folder.mkdir()

    def ctrl_c_launcher():
        tmp_path = folders["ctrl_c_launcher"]
        ck, run_dir = tmp_path / "ck", tmp_path / "run"
        cmd = _launch(2, [*TINY, "train.train_iters=100000", f"checkpoint.save={ck}", f"run.dir={run_dir}"], tmp_path)
        return _interrupt_after_rows(cmd, tmp_path, run_dir)

    def ctrl_c_train_py():
        tmp_path = folders["ctrl_c_train_py"]
        run_dir = tmp_path / "run"
        args = [str(REPO / "train.py"), "model=tiny", "train.eval_interval=null", "train.train_iters=100000",
                f"run.dir={run_dir}"]
        return _interrupt_python_after_rows(args, tmp_path, run_dir)

    def fresh_run():
        tmp_path = folders["fresh_run"]
        taken = tmp_path / "outputs" / "tiny-tp2pp1-fp32"
        taken.mkdir(parents=True)
        (taken / "config.yaml").write_text("x: 1\n")
        (taken / "metrics.jsonl").write_text('{"split": "train", "iteration": 1}\n')
        env = _env()  # the launcher too served warm (suite time: the folder's line, not the agent, is the subject)
        return subprocess.run(warm_command(_launch(2, [*TINY, "train.train_iters=2"], tmp_path), env), cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)

    jobs = {"ctrl_c_launcher": ctrl_c_launcher, "ctrl_c_train_py": ctrl_c_train_py, "fresh_run": fresh_run}
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        yield {name: (lambda name=name, f=f: (folders[name], f.result())) for name, f in futures.items()}


def test_ctrl_c_under_the_launcher_saves_and_says_so_in_one_line(launcher_jobs):
    tmp_path, (code, err) = launcher_jobs["ctrl_c_launcher"]()
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    assert code == 130, err[-3000:]
    last = int((ck / "latest").read_text())
    assert last >= 3 and read_rows(run_dir)[-1]["iteration"] == last
    assert (ck / f"iter_{last:07d}" / ".metadata").is_file()
    assert err.splitlines() == [f"interrupted: iteration {last} saved to {ck}/iter_{last:07d}; "
                                f"resume with checkpoint.load={ck} run.dir={run_dir}"]


def test_ctrl_c_without_checkpoint_save_names_the_key(launcher_jobs):
    tmp_path, (code, err) = launcher_jobs["ctrl_c_train_py"]()
    run_dir = tmp_path / "run"
    assert code == 130, err[-3000:]
    last = read_rows(run_dir)[-1]["iteration"]
    assert err.splitlines() == [f"interrupted after iteration {last}: nothing saved; set checkpoint.save=DIR to "
                                "save when stopped"]


def test_launcher_fresh_run_moves_on_and_says_so_once(launcher_jobs):
    """The default folder (named by the config) holds a run: the fresh run goes to `<dir>-2` and says so once.
    (The same folder given as run.dir= is refused: tests/test_rundir.py; a refusal is printed once under the
    launcher: tests/test_torchrun.py.)"""
    tmp_path, proc = launcher_jobs["fresh_run"]()
    taken = tmp_path / "outputs" / "tiny-tp2pp1-fp32"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "run.dir: outputs/tiny-tp2pp1-fp32 already holds a run; this run writes to outputs/tiny-tp2pp1-fp32-2 "
        "(pick the folder with run.dir=, or resume with checkpoint.load=)"]
    assert [r["iteration"] for r in read_rows(tmp_path / "outputs" / "tiny-tp2pp1-fp32-2")] == [1, 2]
    assert (taken / "metrics.jsonl").read_text() == '{"split": "train", "iteration": 1}\n'


def test_make_train_sweeps_the_layouts_given_in_args(tmp_path):
    """`make train ARGS="-m parallel=..."`: Hydra reads -m before the experiment's override; both layouts run to the
    same losses, each job saves into its own folder, and the experiment's run folder, holding a run, gives way to
    `-2` as a single run's would. (The Makefile's own recipe, run from an empty folder with this interpreter served
    warm as its PY: tests/warm_python.py; suite time: the recipe and the sweep, not interpreter start-up, are the
    subject, and Ctrl-C under a fresh launcher is the test above.)"""
    taken = tmp_path / "outputs" / "shakespeare_cpu"
    taken.mkdir(parents=True)
    (taken / "config.yaml").write_text("x: 1\n")
    (taken / "metrics.jsonl").write_text('{"split": "train", "iteration": 1}\n')
    args = "-m parallel=tp2pp1,tp1pp2 train.train_iters=2 train.eval_interval=null"
    env = _env()
    cmd = ["make", "-s", "-o", "setup", "-f", str(REPO / "Makefile"), "train", f"PY={warm_command([sys.executable], env)[0]}",
           "NPROC=2", f"ARGS={args}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("sweep: outputs/shakespeare_cpu holds a run; this sweep writes to outputs/shakespeare_cpu-2 (pick the "
            "folder with run.dir=)") in proc.stderr.splitlines()
    assert sorted(p.name for p in taken.iterdir()) == ["config.yaml", "metrics.jsonl"]
    root = tmp_path / "outputs" / "shakespeare_cpu-2"
    jobs = ["parallel=tp2pp1", "parallel=tp1pp2"]
    summary = json.loads((root / "summary.json").read_text())
    assert [(j["dir"], j["status"]) for j in summary["jobs"]] == [(job, "completed") for job in jobs]
    losses = [[r["lm_loss"] for r in read_rows(root / job)] for job in jobs]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-5)  # DESIGN.md §3: fp32, dropout 0
    for job in jobs:  # `checkpoint.save: ${run.dir}/checkpoints` is each job's own folder
        assert (root / job / "checkpoints" / "latest").read_text().strip() == "2"
