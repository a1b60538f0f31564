"""Megatron-LM's ``pretrain_gpt.py`` arguments as mptrain overrides (`translate`), by the rows of
`mptrain.megatron.table`.

Every argument ends in one of four lists of the `Translation`: carried (overrides), carried with
nothing to set, written by name (not in the table, but mptrain has a key of the same name:
`mptrain.config.suggest`), or not carried (with why). Megatron's defaults that differ from
mptrain's, as ``conf/`` composes them for the options the script selects, are written out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from mptrain.config.suggest import closest_keys, known_keys
from mptrain.megatron.table import BY_FLAG, NOTHING, NO_EQUIVALENT, UNSET, VALUE, Row, Uncarried, hydra_value

GROUP_ORDER = ("precision", "loss_scaler", "optim", "data", "logger")
"""Config-group options come first in the command, in this order."""
PRECISION_RANK = {"fp32": 0, "fp16": 1, "bf16": 2, "fp8": 3}
"""--bf16 with --fp8-format: Megatron's fp8 runs on bf16 params, which mptrain's precision=fp8 is."""


class MissingValues(ValueError):
    """Arguments of the table that take a value and were given none, as a script's unset ``$1`` leaves them
    (``--save $CHECKPOINT_PATH``; Megatron's argparse stops there too). ``flags``: in the order given."""

    def __init__(self, flags: list) -> None:
        super().__init__(f"{', '.join(flags)} got no value")
        self.flags = flags


@dataclasses.dataclass
class Translation:
    overrides: list
    """``key=value`` / ``group=option`` strings, the command's overrides in order."""
    defaults: list = dataclasses.field(default_factory=list)
    """[(flag, override)]: Megatron's defaults written because mptrain's differ (also in ``overrides``)."""
    nothing: list = dataclasses.field(default_factory=list)
    """[(argument as given, why)]: carried, nothing to set."""
    by_name: list = dataclasses.field(default_factory=list)
    """[(argument as given, override)]: not in the table; mptrain has a key of that name (also in ``overrides``)."""
    uncarried: list = dataclasses.field(default_factory=list)
    """[(flag, argument as given, status, why)]."""
    replaced: list = dataclasses.field(default_factory=list)
    """[argument as given]: data arguments replaced by data=mock (``mock_data``)."""


def group_args(argv: Sequence[str]) -> list:
    """``[(flag, [values])]`` in order: a flag is a word starting with ``--``; its values follow it.

    ``--flag=value`` is split; quotes a script left on a value (``'99,1,0'``) are stripped.
    Raises:
        ValueError: words before the first flag.
    """
    out: list = []
    for word in argv:
        if word.startswith("--") and len(word) > 2:
            flag, eq, value = word.partition("=")
            out.append((flag, [value] if eq else []))
        elif not out:
            raise ValueError(f"{word!r} comes before any --argument; pass pretrain_gpt.py's arguments")
        else:
            out[-1][1].append(_unquote(word))
    return out


def _unquote(word: str) -> str:
    return word[1:-1] if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"" else word


def _as_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return hydra_value(str(value)) if isinstance(value, str) else str(value)


def _shown(flag: str, values: list) -> str:
    return " ".join([flag, *values])


def _carry(row: Row, values: list, given: dict, world_size: int) -> list:
    """The overrides of one carried argument (raises Uncarried); ``given``: {flag: values} of the whole command."""
    if row.convert is not None:
        return row.convert(values, **row.read_from(given, world_size))
    if not row.takes_value:
        return [f"{row.key}={_as_text(True if row.set is VALUE else row.set)}"]
    return [f"{row.key}={_as_text(' '.join(values))}"]


def translate(argv: Sequence[str], *, world_size: int = 1, mock_data: bool = False,
              defaults_of: Optional[Any] = None) -> Translation:
    """The mptrain overrides for Megatron's arguments ``argv`` on ``world_size`` processes.

    Args:
        argv: ``pretrain_gpt.py``'s arguments (`mptrain.megatron.shell.read_script`'s ``args``).
        world_size: processes of the launch (``--global-batch-size``'s default is micro × dp).
        mock_data: train on data=mock instead of the script's data arguments (listed in ``replaced``).
        defaults_of: ``defaults_of(group_options) -> {dotted key: value}``, mptrain's defaults for the
            chosen options; default `composed_defaults` (Hydra composes ``conf/``).
    Raises:
        ValueError: words before the first --argument.
        MissingValues: arguments that take a value were given none (checked before anything is translated).
    """
    args = group_args(argv)
    # an empty value is an unset variable too (`--save "$CHECKPOINT_PATH"`)
    missing = [flag for flag, values in args if not any(values) and flag in BY_FLAG and BY_FLAG[flag].takes_value]
    if missing:
        raise MissingValues(list(dict.fromkeys(missing)))
    given = {flag: values for flag, values in args}
    out = Translation(overrides=[])
    chosen: dict = {}  # key or group -> value, last one wins (argparse)
    known = known_keys(_schema())
    for flag, values in args:
        row = BY_FLAG.get(flag)
        shown = _shown(flag, values)
        if row is None:
            _by_name(flag, values, shown, known, chosen, out)
            continue
        if row.status == NOTHING:
            out.nothing.append((shown, row.why))
            continue
        if row.status != "carried":
            out.uncarried.append((flag, shown, row.status, row.why))
            continue
        if not row.takes_value and values:
            out.uncarried.append((flag, shown, NO_EQUIVALENT, f"{flag} is a switch; the words after it are not Megatron's"))
            continue
        try:
            overrides = _carry(row, values, given, world_size)
        except Uncarried as err:
            out.uncarried.append((flag, shown, err.status, err.why))
            continue
        if not overrides:
            out.nothing.append((shown, row.why))
        # data=mock keeps data.split (a split of weight 0 has no data there too, as Megatron's mock datasets)
        if mock_data and overrides and all(o.lstrip("+").startswith("data") and not o.startswith("data.split=")
                                           for o in overrides):
            out.replaced.append(shown)
            continue
        for o in overrides:
            _choose(chosen, o)
    if mock_data:
        _choose(chosen, "data=mock")
    pending = [(row.flag, o) for row in BY_FLAG.values() if row.default is not UNSET and row.flag not in given
               for o in _default_overrides(row, given, world_size)]
    # options first (optim=adamw), then the keys against the defaults of the options chosen
    for wanted_groups in (True, False):
        groups = [f"{k}={v}" for k, v in chosen.items() if "." not in k]
        mptrain = (defaults_of or composed_defaults)(groups)
        for flag, override in pending:
            key, _, value = override.partition("=")
            if ("." not in key) != wanted_groups or key in chosen:
                continue
            if not _same(mptrain.get(key if "." in key else f"{key}.name"), value):
                _choose(chosen, override)
                out.defaults.append((flag, override))
    order = {g: i for i, g in enumerate(GROUP_ORDER)}
    group_first = sorted((k for k in chosen if "." not in k), key=lambda k: order.get(k, len(order)))
    out.overrides = [f"{k}={chosen[k]}" for k in group_first] + [f"{k}={v}" for k, v in chosen.items() if "." in k]
    return out


def _by_name(flag: str, values: list, shown: str, known: list, chosen: dict, out: Translation) -> None:
    """An argument the table does not have: written by name where mptrain has a key of that name."""
    name = flag[2:].replace("-", "_")
    keys = closest_keys(name, known)
    if len(keys) == 1 and keys[0].rpartition(".")[2] == name:
        override = f"{keys[0]}={_as_text(' '.join(values)) if values else 'true'}"
        _choose(chosen, override)
        out.by_name.append((shown, override))
        return
    hint = f"; the closest key is {' or '.join(keys)}" if keys else ""
    out.uncarried.append((flag, shown, NO_EQUIVALENT, f"not in the translation table{hint}"))


def _choose(chosen: dict, override: str) -> None:
    key, _, value = override.partition("=")
    if key == "precision" and key in chosen and PRECISION_RANK.get(chosen[key], 0) > PRECISION_RANK.get(value, 0):
        return
    chosen.pop(key, None)  # a later value moves the key to its place
    chosen[key] = value


def _default_overrides(row: Row, given: dict, world_size: int) -> list:
    """The overrides Megatron's default of ``row`` means for these arguments ([]: nothing to write)."""
    if row.flag == "--global-batch-size":  # Megatron: micro × dp
        if "--micro-batch-size" not in given:
            return []
        tp = int(given.get("--tensor-model-parallel-size", ["1"])[0])
        pp = int(given.get("--pipeline-model-parallel-size", ["1"])[0])
        dp = max(world_size // (tp * pp), 1)
        return [f"{row.key}={int(given['--micro-batch-size'][0]) * dp}"]
    value = row.default(given) if callable(row.default) else row.default
    if callable(row.default) and value is None:
        return []
    if row.convert is not None:
        return row.convert([str(value)])
    return [f"{row.key}={_as_text(value)}"]


def _same(mptrain_value: Any, text: str) -> bool:
    """Whether mptrain's composed value equals an override's value text."""
    if mptrain_value is None:
        return text == "null"
    if isinstance(mptrain_value, bool):
        return text == ("true" if mptrain_value else "false")
    try:
        return float(mptrain_value) == float(text)
    except (TypeError, ValueError):
        return str(mptrain_value) == text.strip('"')


def _schema():
    from mptrain.config.schema import Config

    return Config()


def composed_defaults(groups: Sequence[str]) -> dict:
    """``{dotted key: value}`` of mptrain's config composed from ``conf/`` with the options ``groups``
    (``["optim=adamw", "precision=fp16"]``), as ``python train.py <groups>`` would see it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mptrain.config.schema import register
    from mptrain.resources import conf_dir

    register()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(groups))
    return _flatten(OmegaConf.to_container(cfg, resolve=True), "")


def _flatten(tree: Any, prefix: str) -> dict:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out
