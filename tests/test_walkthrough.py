"""docs/WALKTHROUGH.md, run as written: every ```bash line and ```python block, in order, in an empty folder.

To stay fast, each command runs where it is cheapest without changing what it does: `python -m
mptrain.<tool> ARGS` calls the tool's `main(ARGS)` in this process (generation: in a pool worker, as
it initialises torch.distributed), `torchrun --nproc_per_node=N train.py ARGS` / `python train.py
ARGS` run the same overrides through `mptrain.training.run.run` on an N-rank gloo pool
(tests/harness.py), and the one `torchrun ... -m mptrain.generate` line is a real torchrun launch (torch's own
agent and workers, each forked with torch imported: tests/warm_python.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job
from warm_python import warm_command, warm_env

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "WALKTHROUGH.md"


def _blocks() -> list:
    """[(kind, text)] of the doc's fenced bash (one command per line) and python blocks, in order."""
    out = []
    for kind, body in re.findall(r"```(bash|python)\n(.*?)```", DOC.read_text(), flags=re.S):
        if kind == "bash":
            out += [("bash", line) for line in body.splitlines() if line.strip()]
        else:
            out.append(("python", body))
    return out


def _train_task(rank: int, world: int, cwd: str, overrides: list):
    os.chdir(cwd)
    try:
        return run_job(rank, world, overrides)
    finally:
        os.chdir(REPO)


def _generate_task(rank: int, world: int, cwd: str, argv: list) -> tuple:
    from mptrain.generate import main

    os.chdir(cwd)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            code = main(argv)
        return code, buf.getvalue()
    finally:
        os.chdir(REPO)


def _tool_main(module: str):
    import importlib

    return importlib.import_module(module).main


def test_walkthrough_runs_as_written(tmp_path, monkeypatch, request):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    printed = []  # stdout of each generate command / python block, in order
    launched = []  # (index in printed, the running torchrun launch)
    request.addfinalizer(lambda: [proc.kill() for _, proc in launched if proc.poll() is None])
    for kind, text in _blocks():
        if kind == "python":
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(text, str(DOC), "exec"), {"__name__": "__walkthrough__"})  # noqa: S102
            printed.append(buf.getvalue())
            continue
        argv = shlex.split(text)
        world = int(argv[1].split("=")[1]) if argv[0] == "torchrun" else 1
        rest = argv[2:] if argv[0] == "torchrun" else argv[1:]
        if rest[0] == "train.py":
            run_distributed(_train_task, world, str(tmp_path), rest[1:])
        elif rest[:2] == ["-m", "mptrain.generate"] and world > 1:
            env = warm_env({**os.environ,  # its workers served warm (tests/warm_python.py; suite time)
                            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])})
            # `torchrun` is `python -m torch.distributed.run`, its agent served warm too (suite time: ~1.7 CPU-s of
            # imports; the generated text, not the launch, is the subject)
            launcher = warm_command([sys.executable, "-m", "torch.distributed.run"], env)
            # runs while the next commands run (suite time: they read only what earlier commands wrote, and they
            # leave a core idle); its output takes its place in `printed` once it ended
            launched.append((len(printed), subprocess.Popen([*launcher, *argv[1:]], cwd=tmp_path, env=env,
                                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
            printed.append(None)
        elif rest[:2] == ["-m", "mptrain.generate"]:
            code, out = run_distributed(_generate_task, 1, str(tmp_path), rest[2:])[0]
            assert code == 0, text
            printed.append(out)
        else:
            assert rest[0] == "-m" and rest[1].startswith("mptrain."), text
            assert _tool_main(rest[1])(rest[2:]) == 0, text

    for index, proc in launched:
        try:
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr[-3000:]
        printed[index] = stdout
    w = tmp_path / "walkthrough"
    # 2 + 3: one run folder, iterations 1-4 at tp2pp2 then 5-8 resumed at tp2pp1; valid rows at 0, 4, 8
    rows = read_rows(w / "runs" / "pretrain")
    assert [r["iteration"] for r in rows] == list(range(1, 9))
    assert [r["consumed_samples"] for r in rows] == [8 * i for i in range(1, 9)]
    assert [r["iteration"] for r in read_rows(w / "runs" / "pretrain", "valid")] == [0, 4, 8]
    log = (w / "runs" / "pretrain" / "train.log").read_text()
    assert "saved at tp2 pp2 dp1" in log and "layout changed" in log
    layout = json.loads((w / "runs" / "pretrain" / "layout.json").read_text())
    assert layout["world_size"] == 2
    # 4: fine-tuning from iteration 8 starts at 1 with the new warm-up
    ft = read_rows(w / "runs" / "finetune")
    assert [r["iteration"] for r in ft] == [1, 2, 3, 4] and ft[0]["lr"] == 0.0 and ft[2]["lr"] == 5e-4
    assert "fine-tuning from the weights of iteration 8" in (w / "runs" / "finetune" / "train.log").read_text()
    # 5 + 6: greedy at tp1 == tp2 == transformers on the export; the sampled text is another text
    greedy_tp1, greedy_tp2, sampled, hf = printed[1:]
    assert greedy_tp1 == greedy_tp2 == hf and greedy_tp1.startswith("to be or")
    assert len(greedy_tp1.split()) > 3 and sampled.startswith("to be or")
    assert sorted(p.name for p in (w / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json"]
