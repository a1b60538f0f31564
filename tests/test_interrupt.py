"""The Ctrl-C line's resume command is one a user can paste: the shell splits it into the overrides and
Hydra parses each back to the folder, whatever characters the folders hold. The line under a real
launcher is tests/test_quickstart.py."""

from __future__ import annotations

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from mptrain.training.interrupt import Stop, interrupted_line

FOLDERS = ["/runs/a/checkpoints", "/runs/my run/checkpoints", "/runs/lr=3e-4,wd=0.1/ck", "/runs/[x]/it's",
           'C:\\runs\\"q"\\', "/runs/$HOME/ck"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_resume_command_parses_back_to_the_folders(folder):
    run_dir = folder.rsplit("/", 1)[0] or folder
    line = interrupted_line(Stop(2, 4, folder, run_dir))
    assert line.startswith(f"interrupted: iteration 4 saved to {folder}/iter_0000004; resume with ")
    words = shlex.split(line.split("; resume with ", 1)[1])
    parser = OverridesParser.create()
    parsed = {o.key_or_group: o.value() for o in parser.parse_overrides(words)}
    assert parsed == {"checkpoint.load": folder, "run.dir": run_dir}


def test_a_plain_folder_stays_unquoted():
    line = interrupted_line(Stop(2, 8, "/runs/a/checkpoints", "/runs/a"))
    assert line.endswith("resume with checkpoint.load=/runs/a/checkpoints run.dir=/runs/a")
