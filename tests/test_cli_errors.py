"""An override Hydra cannot compose is one line on stderr, printed once, exit 1 (DESIGN.md §5)."""

import signal
from pathlib import Path

import pytest

from mptrain.config.cli import FIX, compose_error, exit_on_compose_error
from mptrain.config.schema import register
from mptrain.training import run as run_module
from procs import run_python

CONF = Path(__file__).resolve().parents[1] / "conf"
# Hydra lists the shipped YAMLs and the schema's node of the group (registered by `register`)
MODELS = ", ".join(sorted([*(p.stem for p in (CONF / "model").glob("*.yaml")), "base_model"]))

register()


@pytest.mark.parametrize("argv, message", [
    (["train.manual_gc=yes_please"], f"train.manual_gc=yes_please: Value 'yes_please' is not a valid bool (type str); {FIX}"),
    (["parallel=tp2pp2", "optim.lr=abc"], f"optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float; {FIX}"),
    (["train.nosuch_key=3"], f"Could not override 'train.nosuch_key': Key 'nosuch_key' not in 'TrainConfig'; {FIX}"),
    (["model=nosuch"], f"In 'config': Could not find 'model/nosuch'; Available options in 'model': {MODELS}"),
])
def test_composition_errors_are_one_line_naming_the_key(argv, message):
    assert compose_error(argv, str(CONF)) == message


@pytest.mark.parametrize("argv", [
    [], ["experiment=shakespeare_cpu", "train.train_iters=40", "train.eval_interval=null"],
    ["parallel=tp2pp4", "precision=fp16", "model=gpt_2.7b", "optim.lr=3e-4", "optim._target_=torch.optim.RMSprop"],
    ["-m", "optim.lr=abc"],  # a sweep: each job composes and fails on its own (the sweep summary)
    ["--cfg", "job", "optim.lr=abc"], ["hydra.run.dir=/tmp/x", "optim.lr=abc"],  # Hydra's own handling
])
def test_composable_or_hydras_own_command_lines_pass(argv):
    assert compose_error(argv, str(CONF)) is None


def test_train_py_prints_the_line_alone_and_writes_nothing(tmp_path):
    proc = run_python([str(CONF.parent / "train.py"), "optim.lr=abc", f"run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                      timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"error: optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float; {FIX}"]
    assert list(tmp_path.iterdir()) == []


def test_only_rank_0_prints_and_every_rank_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(run_module, "CONFIG_ERROR_GRACE_S", 0.0)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the grace's SIGTERM handler: not in pytest
    lines = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as exit_info:
            exit_on_compose_error(str(CONF), ["model=nosuch"])
        assert exit_info.value.code == 1
        lines[rank] = capsys.readouterr().err.splitlines()
    assert lines == {0: [f"error: In 'config': Could not find 'model/nosuch'; Available options in 'model': {MODELS}"],
                     1: []}
