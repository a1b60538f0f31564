"""Ctrl-C as a clean stop: one line saying what was saved, exit code 130, no traceback.

The loop already treats SIGINT like SIGTERM (`mptrain.training.watchdog.StopSignal`): every rank
finishes its step and, when `checkpoint.save` is set, saves it. What this module adds is the end
a user sees: the loop raises `Interrupted` after its last save, and the entry point
(`mptrain.training.run.hydra_main`) then prints one line on rank 0 and exits 130, the code shells report for a job ended by Ctrl-C
(128 + SIGINT). SIGTERM (a scheduler's stop) keeps exit 0, so a job split across time limits
ends cleanly. `mptrain.launch` passes the workers' 130 through without torchrun's report.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import signal
import sys
from typing import NoReturn, Optional

from mptrain.errors import launch_rank_and_world

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130: what a shell reports for a job ended by Ctrl-C


@dataclasses.dataclass
class Stop:
    """How a stop signal ended the loop: the signal, the last finished iteration, the save folder
    (`checkpoint.save`, None when unset: a stop saves its iteration whenever the folder is set) and the
    run folder (named in the resume line: a resume without it would write a fresh run to the config's
    folder, `mptrain.runs.folder`)."""

    signum: int
    iteration: int
    save: Optional[str]
    run_dir: Optional[str] = None


class Interrupted(Exception):
    """Ctrl-C ended the training loop cleanly: raised by the loop once the last step is finished, saved
    (when `checkpoint.save` is set) and summarised; the entry point turns it into `exit_interrupted`."""

    def __init__(self, stop: Stop):
        super().__init__(interrupted_line(stop))
        self.stop = stop


def interrupt_of(signum: Optional[int], *, iteration: int, save: Optional[str],
                 run_dir: Optional[str] = None) -> Optional[Interrupted]:
    """The `Interrupted` to raise when a stop signal ended the loop after `iteration` and it was
    SIGINT (Ctrl-C); None for SIGTERM (a scheduler's stop ends with exit 0) or no signal. ``save``:
    `checkpoint.save`; ``run_dir``: the run folder, named in the resume line beside it."""
    if signum != signal.SIGINT:
        return None
    return Interrupted(Stop(int(signum), iteration, save or None, run_dir))


_PLAIN = re.compile(r"[A-Za-z0-9_./+-]*/[A-Za-z0-9_./+-]*")  # holds a "/": never a number, bool or null to Hydra


def override_word(key: str, value: str) -> str:
    """``key=value`` as one shell word that Hydra composes back to the string ``value``.

    A path of plain characters holding a ``/`` goes as it is. Anything else (``null``, ``1e-4``, ``true``
    would parse as null, a float, a bool; spaces, ``,``, ``=`` or brackets would split the word or make a
    list) goes in Hydra's double quotes inside the shell's single quotes. Hydra's escapes: ``"`` as
    ``\\"``, backslashes doubled only where they precede a quote or the closing one, and ``${`` as
    ``\\${`` (else OmegaConf reads an interpolation).
    """
    if _PLAIN.fullmatch(value):
        return f"{key}={value}"
    quoted = re.sub(r'(\\*)("|$)', lambda m: 2 * m.group(1) + ('\\"' if m.group(2) else ""), value)
    quoted = quoted.replace("${", "\\${")
    return shlex.quote(f'{key}="{quoted}"')


def interrupted_line(stop: Optional[Stop]) -> str:
    """The one line for a Ctrl-C stop (`stop` None: interrupted before the first iteration)."""
    if stop is None:
        return "interrupted before the first iteration: nothing saved"
    if stop.save is not None:
        run_dir = f" {override_word('run.dir', stop.run_dir)}" if stop.run_dir else ""
        return (f"interrupted: iteration {stop.iteration} saved to {stop.save}/iter_{stop.iteration:07d}; "
                f"resume with {override_word('checkpoint.load', stop.save)}{run_dir}")
    return (f"interrupted after iteration {stop.iteration}: nothing saved; set checkpoint.save=DIR to save "
            "when stopped")


def exit_interrupted(stop: Optional[Stop]) -> NoReturn:
    """Print `interrupted_line` on rank 0 (stderr, one write) and exit `INTERRUPTED_EXIT_CODE` on every rank."""
    try:
        rank = launch_rank_and_world()[0]
    except ValueError:
        rank = 0
    if rank == 0:
        sys.stderr.write(interrupted_line(stop) + "\n")
        sys.stderr.flush()
    sys.exit(INTERRUPTED_EXIT_CODE)
