"""Command-line overrides Hydra cannot compose: one line on stderr, printed once, exit 1 (DESIGN.md §5).

Hydra answers an override it cannot compose (a value of the wrong type, an unknown key, a missing
option of a config group) with a multi-line message of its own, printed by every rank under
torchrun. `exit_on_compose_error` composes the command line once before ``@hydra.main`` does, with
Hydra's own compose API, and turns such an error into one line, e.g.

    error: train.manual_gc=yes_please: Value 'yes_please' is not a valid bool (type str); `python train.py --cfg job` lists every key and its value

Only rank 0 prints it; every rank exits 1 before any collective (`exit_on_compose_error`). Command lines with
Hydra flags (``-m``, ``--cfg``, ``--help``, ...) or ``hydra.*`` overrides are left to Hydra, as are
sweeps: their jobs compose one by one and fail through the sweep summary.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

FIX = "`python train.py --cfg job` lists every key and its value"


def _overrides(argv: list) -> Optional[list]:
    """The overrides of ``argv`` (program name excluded), or None where Hydra's own handling is needed."""
    if any(a.startswith("-") for a in argv):
        return None  # a Hydra flag: -m / --multirun, --cfg, --help, --config-name, ...
    if any(a.lstrip("+~").startswith(("hydra.", "hydra/")) for a in argv):
        return None
    return list(argv)


def _one_line(err: BaseException) -> str:
    """Hydra's message (and its cause's) as one line: no search path, options joined, no blank lines."""
    parts: list = []
    for exc in (err, err.__cause__):
        if exc is None:
            continue
        options: list = []
        for raw in str(exc).splitlines():
            line = raw.strip()
            if line.startswith("Config search path:"):
                break
            if not line or line.startswith(("reference_type=", "object_type=", "full_key:", "To append to your config")):
                continue
            if raw.startswith("\t"):  # an option of "Available options in 'group':"
                options.append(line)
                continue
            if options:
                parts[-1] += " " + ", ".join(options)
                options = []
            parts.append(line.replace("Error merging override ", "").rstrip("."))
        if options:
            parts[-1] += " " + ", ".join(options)
    return ": ".join(parts) if len(parts) == 2 and err.__cause__ is not None else "; ".join(parts)


def compose_error(argv: list, config_dir: str, config_name: str = "config") -> Optional[str]:
    """The one-line message for the overrides in ``argv`` that Hydra cannot compose, or None.

    Args:
        argv: the command line after the program name (``sys.argv[1:]``).
        config_dir: the primary config folder (``conf/``); config_name: its top config.
    Returns:
        ``"<what Hydra said>; <fix>"`` (no ``error:`` prefix) or None (composes, or left to Hydra:
        see the module docstring).
    """
    overrides = _overrides(argv)
    if overrides is None:
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return None  # inside someone's Hydra context (a test, a notebook): theirs to compose
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            compose(config_name, overrides=overrides)
    except Exception as err:  # noqa: BLE001 - every composition failure is the user's command line
        line = _one_line(err)
        fixed = "Available options in" in line or "Ambiguous value" in line  # Hydra's text names the fix
        return line if fixed else f"{line}; {FIX}"
    finally:
        GlobalHydra.instance().clear()
    return None


def exit_on_compose_error(config_dir: str, argv: Optional[list] = None) -> None:
    """`compose_error` on ``sys.argv[1:]``: a symmetric `ConfigError`, reported as the trainer reports
    one (`mptrain.training.run.exit_on_config_error`: rank 0 prints ``error: ...``, every rank exits 1
    after the torchrun grace); returns when the command line composes."""
    message = compose_error(sys.argv[1:] if argv is None else argv, config_dir)
    if message is None:
        return
    from mptrain.errors import ConfigError
    from mptrain.training.run import exit_on_config_error

    err = ConfigError(message)
    err.symmetric = True  # the same command line on every rank
    exit_on_config_error(err)
