"""``python -m mptrain.from_megatron``: a Megatron-LM launch as the mptrain command that trains the same.

    python -m mptrain.from_megatron examples/gpt3/train_gpt3_175b_distributed.sh CKPT TB VOCAB MERGES DATA
    python -m mptrain.from_megatron --world-size 8 -- --num-layers 4 --hidden-size 128 ...
    python -m mptrain.from_megatron --mock-data SCRIPT ...   # the script's data arguments -> data=mock
    python -m mptrain.from_megatron --cpu --mock-data SCRIPT # a trial on CPU processes (gloo): `CPU_FORMS`
    python -m mptrain.from_megatron --table                  # the mapping, as docs/MEGATRON.md's table

A script is read, not run (`mptrain.megatron.shell`): its arguments after the script are its $1, $2, ...
The command goes to stdout; the report (Megatron defaults written out, arguments carried with
nothing to set, arguments not carried and why) to stderr. Ends 0; 2 with one line on stderr when an
argument that takes a value got none (the script's own arguments not given: the line shows them); 1 with
one line on stderr for any other error.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Optional, Sequence

from mptrain.errors import ConfigError
from mptrain.megatron.shell import Launch, read_script
from mptrain.megatron.table import ROWS, UNSET, Row
from mptrain.megatron.translate import MissingValues, Translation, translate

USAGE = ("usage: python -m mptrain.from_megatron [--cpu] [--mock-data] SCRIPT [SCRIPT_ARGS ...] | "
         "[--cpu] [--mock-data] [--world-size N] -- MEGATRON_ARGS ... | --table")
OPTIONS = ("--cpu", "--mock-data", "--world-size", "--table", "-h", "--help")

CPU_FORMS = {
    # an override of the translation -> what a trial on CPU processes adds to it, and why
    "precision=fp8": (["precision.fp8_emulate=true", "precision.fp8_gemm_filter=none"],
                      "CPUs have no FP8 GEMMs: torchao's emulation, on every linear (the size filter is for GPU speed)"),
}
"""``--cpu``: the translated command's GPU-only choices in the form that runs on CPU processes (gloo)."""


def world_size_of(launcher: Sequence[str]) -> int:
    """Processes of a torchrun launch: --nproc_per_node × --nnodes (1 each when absent; ``--nnodes 1:4``: 4)."""
    def value(*names: str) -> int:
        for i, word in enumerate(launcher):
            flag, eq, text = word.partition("=")
            if flag in names:
                text = text if eq else (launcher[i + 1] if i + 1 < len(launcher) else "1")
                return int(text.rpartition(":")[2])
        return 1
    return value("--nproc_per_node", "--nproc-per-node") * value("--nnodes")


def command(launcher: Sequence[str], overrides: Sequence[str]) -> str:
    """The shell command: the launcher (torchrun and its flags, or python), train.py, the overrides."""
    head = " ".join(shlex.quote(w) for w in [*launcher, "train.py"])
    return " \\\n    ".join([head, *(shlex.quote(o) for o in overrides)])


def report(t: Translation, world_size: int) -> str:
    lines = [f"# world size {world_size}"]
    if t.defaults:
        lines.append("# Megatron's defaults, written out because mptrain's differ:")
        lines += [f"#   {override}  ({flag} unset)" for flag, override in t.defaults]
    if t.by_name:
        lines.append("# not in the table, written by name (check the meaning):")
        lines += [f"#   {shown} -> {override}" for shown, override in t.by_name]
    if t.replaced:
        lines.append("# replaced by data=mock (--mock-data): " + "; ".join(t.replaced))
    if t.nothing:
        lines.append("# carried, nothing to set:")
        lines += [f"#   {shown}: {why}" for shown, why in t.nothing]
    lines.append(f"# not carried ({len(t.uncarried)}):" if t.uncarried else "# not carried: none")
    lines += [f"#   {shown}: {status}: {why}" for _, shown, status, why in t.uncarried]
    return "\n".join(lines)


def _mptrain_cell(row: Row) -> str:
    if row.key is not None and row.convert is None:
        if row.takes_value:
            return f"`{row.key}`"
        value = "true" if row.set is True else "false" if row.set is False else row.set
        return f"`{row.key}={value}`"
    if row.convert is not None:
        return row.why or (row.convert.__doc__ or "").strip()
    return ""


def _default_cell(row: Row) -> str:
    if row.default is UNSET:
        return ""
    if callable(row.default):
        return row.default.__doc__.strip()  # a derived default says what it is in its docstring
    return f"`{row.default}`" if row.default is not None else "unset"


def table_markdown() -> str:
    """docs/MEGATRON.md's table: one line per row of `mptrain.megatron.table.ROWS`."""
    lines = ["| Megatron-LM | mptrain | Megatron's default, written when mptrain's differs | not carried / nothing to set: why |",
             "|---|---|---|---|"]
    for row in ROWS:
        why = f"{row.status}: {row.why}" if row.status != "carried" else ""
        lines.append(f"| `{row.flag}` | {_mptrain_cell(row)} | {_default_cell(row)} | {why} |")
    return "\n".join(lines)


def cpu_forms(overrides: Sequence[str]) -> tuple[list, list]:
    """(the overrides `CPU_FORMS` adds for ``--cpu``, the report's lines saying why)."""
    added, lines = [], []
    for override, (extra, why) in CPU_FORMS.items():
        if override in overrides:
            added += extra
            lines.append(f"#   {' '.join(extra)}: {why}")
    return added, lines


def parse(argv: Sequence[str]) -> tuple:
    """(launch, mock_data, world_size given or None, cpu) from the command line, or ("table", ...)."""
    argv = list(argv)
    mock_data, world, cpu = False, None, False
    while argv and argv[0] in OPTIONS:
        option = argv.pop(0)
        if option == "--cpu":
            cpu = True
        elif option == "--mock-data":
            mock_data = True
        elif option == "--world-size":
            world = int(argv.pop(0)) if argv else 0
        elif option == "--table":
            return "table", mock_data, world, cpu
        else:
            return "help", mock_data, world, cpu
    if not argv:
        raise ConfigError(f"nothing to translate; {USAGE}")
    if argv[0] == "--":
        return Launch(launcher=[], script="pretrain_gpt.py", args=argv[1:]), mock_data, world, cpu
    if not os.path.isfile(argv[0]):
        raise ConfigError(f"{argv[0]}: no such script; put -- before Megatron's arguments ({USAGE})")
    with open(argv[0]) as f:
        return read_script(f.read(), argv[1:]), mock_data, world, cpu


def missing_values_line(err: MissingValues, launch: Launch, script: Optional[str]) -> str:
    """The one line for arguments that got no value: which, and the fix (the script's usage, when its own
    arguments are missing; `script`: the script's path as given, None for arguments given after --)."""
    if script is None:
        return f"{err}; give each its value after it ({err.flags[0]} VALUE)"
    if launch.given < len(launch.arguments):
        return (f"{err}: {script} reads {len(launch.arguments)} arguments of its own and was given {launch.given}; "
                f"pass them: python -m mptrain.from_megatron {script} {' '.join(launch.arguments)}")
    return (f"{err}: {script} leaves the variables they read unset; set them in the script, or pass Megatron's "
            "arguments: python -m mptrain.from_megatron -- --num-layers ...")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    launch = None
    try:
        launch, mock_data, world, cpu = parse(argv)
        if launch in ("table", "help"):
            return _print(table_markdown() if launch == "table" else __doc__)
        launcher = list(launch.launcher)
        if launcher and not (os.path.basename(launcher[0]).startswith("python") and len(launcher) == 1):
            world = world or world_size_of(launcher)
        else:  # python pretrain_gpt.py, or the arguments alone
            world = world or 1
            launcher = ["torchrun", f"--nproc_per_node={world}"] if world > 1 else ["python"]
        t = translate(launch.args, world_size=world, mock_data=mock_data)
    except MissingValues as err:  # a usage error, as argparse's: exit 2
        print(f"error: {missing_values_line(err, launch, _script_of(argv))}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    added, why = cpu_forms(t.overrides) if cpu else ([], [])
    code = _print(command(launcher, [*t.overrides, *added]))
    print(report(t, world), file=sys.stderr)
    if cpu:
        print("\n".join(["# --cpu: added for a trial on CPU processes:" if why else "# --cpu: nothing to add", *why]),
              file=sys.stderr)
    return code


def _script_of(argv: Sequence[str]) -> Optional[str]:
    """The script path of a command line `parse` accepted (None: Megatron's arguments after --)."""
    rest = list(argv)
    while rest and rest[0] in ("--cpu", "--mock-data", "--world-size"):
        rest = rest[2:] if rest[0] == "--world-size" else rest[1:]
    return None if not rest or rest[0] == "--" else rest[0]


def _print(text: str) -> int:
    """Print `text` to stdout; 0, or 1 when the reader closed the pipe (`--table | head -3`): no traceback.
    (Python's advice for SIGPIPE: point stdout at devnull, so the flush at exit does not raise again.)"""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
