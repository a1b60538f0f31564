"""The Ctrl-C line's resume command is one a user can paste: the shell splits it into the overrides, and
Hydra's parser and OmegaConf compose each back to the folder's string (spaces, quotes, ``,=[]``, ``${``,
and relative names that would parse as null, a bool or a number). The line under a real launcher is
tests/test_quickstart.py."""

from __future__ import annotations

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from mptrain.training.interrupt import Stop, interrupted_line

FOLDERS = ["/runs/a/checkpoints", "/runs/my run/checkpoints", "/runs/lr=3e-4,wd=0.1/ck", "/runs/[x]/it's",
           'C:\\runs\\"q"\\', "/runs/$HOME/ck", "/runs/${x}/ck", "/runs/${oc.env:HOME}", "/r/a${",
           "null", "true", "1e-4", "ckpts"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_resume_command_parses_back_to_the_folders(folder):
    run_dir = folder.rsplit("/", 1)[0] or folder
    line = interrupted_line(Stop(2, 4, folder, run_dir))
    assert line.startswith(f"interrupted: iteration 4 saved to {folder}/iter_0000004; resume with ")
    words = shlex.split(line.split("; resume with ", 1)[1])
    cfg = OmegaConf.create({"checkpoint": {"load": None}, "run": {"dir": None}})
    for override in OverridesParser.create().parse_overrides(words):  # as Hydra applies a value override
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
    assert OmegaConf.to_container(cfg, resolve=True) == {"checkpoint": {"load": folder}, "run": {"dir": run_dir}}


def test_a_plain_folder_stays_unquoted():
    line = interrupted_line(Stop(2, 8, "/runs/a/checkpoints", "/runs/a"))
    assert line.endswith("resume with checkpoint.load=/runs/a/checkpoints run.dir=/runs/a")


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, 600),  # torchrun's own default would SIGKILL a stop's save after 30 s
    (["--shutdown-timeout=45"], {}, 45),
    ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, 90),
])
def test_the_launcher_gives_a_stop_signals_save_time(argv, environ, expected, monkeypatch):
    from torch.distributed.run import config_from_args, get_args_parser

    from mptrain.launch import with_stop_shutdown_timeout

    args = get_args_parser().parse_args([*argv, "--nproc_per_node=1", "train.py"])
    if not hasattr(args, "shutdown_timeout"):
        pytest.skip("this torchrun has no --shutdown-timeout (its agent waits 30 s)")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    config, _, _ = config_from_args(with_stop_shutdown_timeout(args, environ))
    assert config.shutdown_timeout == expected  # what torchrun's agent waits before its SIGKILL
