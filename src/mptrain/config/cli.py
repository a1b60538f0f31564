"""Command-line overrides Hydra cannot compose: one line on stderr, printed once, exit 1 (DESIGN.md §5).

Hydra answers an override it cannot compose (a value of the wrong type, an unknown key, a missing
option of a config group, a value its grammar cannot parse) with a multi-line message of its own,
printed by every rank under torchrun. `exit_on_compose_error` composes the command line once
before ``@hydra.main`` does, with Hydra's own compose API, and turns such an error into one line
that starts with the override, e.g.

    error: optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float; `python train.py --cfg job` lists every key and its value

Only rank 0 prints it; every rank exits 1 before any collective, without importing torch.
A misspelt key, or Megatron-LM's name of one (``num_layers``), gets the closest key
(``did you mean model.num_layers?``, `mptrain.config.suggest`); Megatron-style flags (``--num-layers 4``),
which Hydra's parser rejects with its usage text, get the overrides they mean (``write model.num_layers=4``).
A sweep (``-m``) is checked as its first job (each swept key at its first value): a misspelt key is one
line before the sweep starts; what only another job's values break fails in that job, through the sweep
summary. Left to Hydra: command lines with other Hydra flags (``--cfg``, ``--help``, ...) or ``hydra.*``
overrides, sweep overrides under a config that sets ``hydra.mode: MULTIRUN``, and any command line while
``HYDRA_FULL_ERROR=1`` (Hydra's full trace, as Hydra documents it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from mptrain.config.suggest import did_you_mean, flags_message, hydra_long_options, known_keys, megatron_flags
from mptrain.errors import CONFIG_ERROR_GRACE_S, launch_rank_and_world, report_and_exit

TRAIN_PROGRAM = "python train.py"
"""The command a fix names unless told another (`mptrain.train.program`: ``python -m mptrain.train``, ...)."""


def fix_for(program: str) -> str:
    """The fix of a line for ``program`` (the command a user ran, e.g. ``python -m mptrain.plan``)."""
    return f"`{program} --cfg job` lists every key and its value"


FIX = fix_for(TRAIN_PROGRAM)
"""The fix of the trainer's lines."""

GRAMMAR = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"


MULTIRUN_FLAGS = ("-m", "--multirun")


def _overrides(argv: list) -> Optional[list]:
    """The overrides of ``argv`` (program name excluded), or None where Hydra's own handling is needed."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":  # Hydra's own test of it
        return None
    if any(a.startswith("-") and a not in MULTIRUN_FLAGS for a in argv):
        return None  # a Hydra flag: --cfg, --help, --config-name, ...
    if any(_key(a).startswith(("hydra.", "hydra/")) for a in argv):
        return None
    return [a for a in argv if a not in MULTIRUN_FLAGS]


def _first_job(overrides: list) -> list:
    """A sweep's first job: each sweep override (``parallel=tp2pp2,tp1pp4``, ``range(...)``) at its first value,
    so that a sweep's misspelt key is found (and named) before the sweep starts, as a single run's is."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, out = OverridesParser.create(), []
    for override in overrides:
        try:
            parsed = parser.parse_override(override)
        except Exception:  # noqa: BLE001 - a grammar error: reported by the composition
            out.append(override)
            continue
        sweep = parsed.is_sweep_override()
        out.append(f"{parsed.get_key_element()}={next(iter(parsed.sweep_string_iterator()))}" if sweep else override)
    return out


def _key(override: str) -> str:
    """The key of an override: ``+train.seed=1`` -> ``train.seed``, ``~model`` -> ``model``."""
    return override.lstrip("+~").split("=")[0]


def _schema_entries(group: str) -> set:
    """Option names the schema registers in ``group`` (``base_model``...): not choices for a user."""
    from hydra.core.config_store import ConfigStore

    return {name.removesuffix(".yaml") for name in ConfigStore.instance().repo.get(group, {})}


def _one_line(err: BaseException) -> str:
    """Hydra's message (and its cause's) as one line: no search path, no blank lines, the options of
    "Available options in 'group':" joined (less the schema's entries)."""
    parts: list = []
    for exc in (err, err.__cause__):
        if exc is None:
            continue
        group, options = None, []
        for raw in str(exc).splitlines() + [""]:
            line = raw.strip()
            if raw.startswith("\t") and group is not None:
                options.append(line)
                continue
            if group is not None:
                parts[-1] += " " + ", ".join(o for o in options if o not in _schema_entries(group))
                group, options = None, []
            if line.startswith("Config search path:"):
                break
            if not line or line.startswith(("reference_type=", "object_type=", "full_key:", "To append to your config")):
                continue
            found = re.match(r"Available options in '([^']+)':", line)
            group = found.group(1) if found else None
            parts.append(line.replace("Error merging override ", "").rstrip("."))
    return ": ".join(parts) if len(parts) == 2 and err.__cause__ is not None else "; ".join(parts)


def _parse_error(override: str) -> Optional[str]:
    """Hydra's grammar error for one override (one line), or None when it parses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(override)
    except Exception as err:  # noqa: BLE001 - Hydra's grammar errors are plain HydraExceptions
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


def _composes(overrides: list, config_dir: str, config_name: str, *, hydra_config: bool = False):
    """Compose once (a fresh Hydra each time): the exception, or None (``hydra_config``: the config
    with its ``hydra`` node, or None when that composition fails)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            cfg = compose(config_name, overrides=overrides, return_hydra_config=hydra_config)
    except Exception as err:  # noqa: BLE001 - every composition failure is the user's command line
        return None if hydra_config else err
    finally:
        GlobalHydra.instance().clear()
    return cfg if hydra_config else None


def _config_keys(overrides: list, config_dir: str, config_name: str) -> list:
    """The keys of the config ``overrides`` compose (or, failing that, of the config alone), less Hydra's own:
    what a misspelt key is matched against (`mptrain.config.suggest`)."""
    cfg = _composes(overrides, config_dir, config_name, hydra_config=True)
    if cfg is None:
        cfg = _composes([], config_dir, config_name, hydra_config=True)
    if cfg is None:
        return []
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra", None)
    return known_keys(tree)


def _multirun_by_config(overrides: list, config_dir: str, config_name: str) -> bool:
    """Whether the command line sweeps (a sweep override) under a config that sets ``hydra.mode:
    MULTIRUN`` itself (an experiment file may): `@hydra.main` then runs it as a sweep without -m,
    while compose, always a single run, would reject the sweep override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    sweeps, plain = [], []
    for override in overrides:
        try:
            (sweeps if parser.parse_override(override).is_sweep_override() else plain).append(override)
        except Exception:  # noqa: BLE001 - a grammar error: reported by the composition below
            plain.append(override)
    if not sweeps:
        return False
    cfg = _composes(plain, config_dir, config_name, hydra_config=True)
    return cfg is not None and str(cfg.hydra.get("mode")) == "RunMode.MULTIRUN"


def _message(err: BaseException, overrides: list, config_dir: str, config_name: str,
             program: str = TRAIN_PROGRAM) -> str:
    """The one-line message for ``err``, starting with the override it is about (where one is found)."""
    for override in overrides:  # the grammar first: its own error names the character
        parse = _parse_error(override)
        if parse is not None:
            return f"{override!r}: {parse}; quote a value with special characters (\"key='...'\"), see {GRAMMAR}"
    line = _one_line(err)
    unknown = re.match(r"Could not override '([^']+)': Key '[^']+' (?:is )?not in", line)
    if unknown:  # a misspelt key, or Megatron's flat name (num_layers): point at the key
        others = [o for o in overrides if _key(o) != unknown.group(1)]
        return f"{line}; {did_you_mean(unknown.group(1), _config_keys(others, config_dir, config_name))}{fix_for(program)}"
    ambiguous = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", line)
    if ambiguous:
        key, value = ambiguous.groups()
        return (f"{key}={value}: a comma makes a sweep; write {key}=[{value}] for a list, \"{key}='{value}'\" "
                "for a string (the shell keeps the inner quotes), or add -m to sweep over the values")
    several = re.match(r"Multiple values for (\S+)\. To override a value use 'override \S+: (\S+)'", line)
    if several:
        group, option = several.groups()
        return f"+{group}={option}: {group} is selected already; select another option with {group}={option} (no +)"
    missing = re.search(r"Could not find '([^'/]+)/([^']*)'", line)
    if missing:  # a config group's option: Hydra's line lists the options (the fix)
        group, option = missing.groups()
        named = [o for o in overrides if _key(o) in (group, group.replace("/", "."))]
        # the override that names the missing option (a group given twice: the other one is fine)
        named = [o for o in named if o.split("=", 1)[-1] == option] or named[-1:]
        return f"{named[0]}: {line}" if named else line
    if "requires --multirun" in line:
        return line  # Hydra's words name the fix
    if not any(_key(o) in line for o in overrides):  # name the override
        if _composes([], config_dir, config_name) is not None:
            return line  # the config tree itself does not compose: no override to blame, no --cfg hint
        alone = [o for o in overrides if _composes([o], config_dir, config_name) is not None]
        if alone:
            line = f"{alone[0]}: {line}"
    return f"{line}; {fix_for(program)}"


def compose_error(argv: list, config_dir: str, config_name: str = "config",
                  program: str = TRAIN_PROGRAM) -> Optional[str]:
    """The one-line message for the overrides in ``argv`` that Hydra cannot compose, or None.

    Args:
        argv: the command line after the program name (``sys.argv[1:]``).
        config_dir: the primary config folder (``conf/``); config_name: its top config.
        program: the command the user ran, named in the fix (its ``--cfg job``).
    Returns:
        ``"<override>: <what is wrong>; <fix>"`` (no ``error:`` prefix), or None: it composes, or it
        is left to Hydra (see the module docstring).
    """
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return None  # inside someone's Hydra context (a test, a notebook): theirs to compose
    flags = [] if os.environ.get("HYDRA_FULL_ERROR") == "1" else megatron_flags(argv, hydra_long_options())
    if flags:  # Hydra's parser would reject them with its usage text and no pointer to the keys
        return flags_message(flags, _config_keys([], config_dir, config_name), program, fix_for(program))
    overrides = _overrides(argv)
    if overrides is None:
        return None
    if any(a in MULTIRUN_FLAGS for a in argv):
        overrides = _first_job(overrides)
    elif _multirun_by_config(overrides, config_dir, config_name):
        return None
    err = _composes(overrides, config_dir, config_name)
    return None if err is None else _message(err, overrides, config_dir, config_name, program)


def exit_on_compose_error(config_dir: str, argv: Optional[list] = None, *,
                          grace_s: float = CONFIG_ERROR_GRACE_S, config_name: str = "config",
                          program: str = TRAIN_PROGRAM) -> None:
    """`compose_error` on ``sys.argv[1:]``: rank 0 prints ``error: ...`` and every rank exits 1
    (`report_and_exit`, the same command line on every rank); returns when the command line composes.
    ``config_name``: the top config (``config`` for training, ``plan`` for the planner); ``program``: the
    command, named in the fix.

    The rank and world size come from torchrun's ``RANK`` / ``WORLD_SIZE`` (or SLURM's
    ``SLURM_PROCID`` / ``SLURM_NTASKS``) directly: nothing else of the launch is needed to report.
    """
    import sys

    message = compose_error(sys.argv[1:] if argv is None else argv, config_dir, config_name, program)
    if message is None:
        return
    try:
        rank, world_size = launch_rank_and_world()
    except ValueError:  # a malformed launcher variable: report as a world of one rather than not at all
        rank, world_size = 0, 1
    report_and_exit(f"error: {message}", rank=rank, world_size=world_size, symmetric=True, grace_s=grace_s)
