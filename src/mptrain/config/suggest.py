"""The closest known key to an unknown one: the "did you mean ...?" of a one-line config error (DESIGN.md §5).

mptrain keeps Megatron-LM's argument names but files them under groups (``model.num_layers``,
``train.micro_batch_size``, ``optim.lr``), so a user who types Megatron's name (``num_layers=4``,
``--num-layers 4``) or misspells one of ours (``train.train_iter``) is pointed at the key:

    train.train_iter            -> train.train_iters        (its own group, by spelling)
    num_layers                  -> model.num_layers         (the same name in another group)
    optim.lr_warmup_sample      -> optim.lr_warmup_samples  (its own group, by spelling)
    trian.train_iters           -> train.train_iters        (the group misspelt, the rest kept)

Spelling is `difflib.get_close_matches` (ratio >= 0.6, its default).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Sequence

CUTOFF = 0.6
"""difflib's similarity ratio a suggestion needs (its own default)."""

MAX_SAME_NAME = 3
"""A name found in more groups than this (``name``, ``seed``...) names no group: too vague to help."""


def known_keys(tree: Any, prefix: str = "") -> list:
    """Dotted paths of every node and leaf of a config tree, e.g. ``["train", "train.seed", ...]``.

    Args:
        tree: a schema dataclass (its fields) or a mapping (its keys; `OmegaConf.to_container` of a DictConfig); anything else is a leaf.
        prefix: the path of ``tree`` itself, with its trailing dot (``"train."``), or "" for the top.
    """
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        items = [(f.name, getattr(tree, f.name)) for f in dataclasses.fields(tree)]
    elif isinstance(tree, Mapping):
        items = list(tree.items())
    else:
        return []
    out = []
    for name, value in items:
        out.append(f"{prefix}{name}")
        out.extend(known_keys(value, f"{prefix}{name}."))
    return out


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _last(path: str) -> str:
    return path.rpartition(".")[2]


def _close(name: str, candidates: Sequence[str]) -> list:
    """The paths among ``candidates`` whose last component is the closest spelling of ``name`` (ties kept)."""
    best = difflib.get_close_matches(name, sorted({_last(c) for c in candidates}), n=1, cutoff=CUTOFF)
    return sorted(c for c in candidates if best and _last(c) == best[0])


def closest_keys(key: str, known: Sequence[str]) -> list:
    """The known keys a user most likely meant by the unknown ``key`` ([] when none is close).

    The first component of ``key`` that is not known is looked up, in this order:
    1. the same name in another group (``num_layers`` -> ``model.num_layers``; Megatron's flat names);
    2. the closest spelling among its own group's keys (``train.train_iter`` -> ``train.train_iters``);
    3. the closest spelling among every group's keys (``micro_batchsize`` -> ``train.micro_batch_size``).
    The components after it are kept where the result is a known key (``trian.train_iters`` ->
    ``train.train_iters``). A name found in more than `MAX_SAME_NAME` places gives [].
    """
    known_set = set(known)
    parts = key.split(".")
    depth = next((i for i in range(len(parts)) if ".".join(parts[: i + 1]) not in known_set), None)
    if depth is None:
        return []  # a known key: nothing to suggest
    group, name, rest = ".".join(parts[:depth]), parts[depth], parts[depth + 1:]
    siblings = [k for k in known if _parent(k) == group]
    same_name = sorted(k for k in known if _last(k) == name and _parent(k) != group)
    found = same_name or _close(name, siblings) or _close(name, list(known))
    if len(found) > MAX_SAME_NAME:
        return []
    whole = [".".join([f, *rest]) for f in found]
    return [w if w in known_set else f for w, f in zip(whole, found)]


def did_you_mean(key: str, known: Sequence[str]) -> str:
    """``"did you mean train.train_iters? "`` (several: ``"a or b"``), or "" when nothing is close."""
    found = closest_keys(key, known)
    return f"did you mean {' or '.join(found)}? " if found else ""


def megatron_flags(argv: Sequence[str], hydra_options: Sequence[str]) -> list:
    """The ``--flag`` arguments of ``argv`` that are not Hydra's options, with their values.

    A Megatron-LM command line (``--num-layers 4 --sequence-parallel``) reaches Hydra's argument parser,
    which rejects it without a pointer to the key. Hydra's own options (``--cfg``, ``--multirun``, ...,
    and their unambiguous abbreviations, as argparse takes them) are not reported.

    Args:
        argv: the command line after the program name.
        hydra_options: Hydra's long option strings (``--cfg``, ``--multirun``, ...).
    Returns:
        ``[(token, name, value)]``: ``("--num-layers", "num_layers", "4")``; the value is the text after
        ``=`` or the next argument when it is not a flag nor an override (no ``=``), else None (a switch).
    """
    found = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--") or len(flag) == 2 or any(o.startswith(flag) for o in hydra_options):
            continue
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if not eq:
            value = following if following and not following.startswith("-") and "=" not in following else None
        found.append((arg, flag[2:].replace("-", "_"), value))
    return found


def flags_message(flags: Sequence[tuple], known: Sequence[str], program: str, fix: str) -> str:
    """One line for Megatron-style flags: each as the override it means (``model.num_layers=4``).

    Args:
        flags: `megatron_flags`'s result (not empty).
        known: the config's keys (`known_keys`).
        program: the command the user ran; fix: the line's closing fix (``--cfg job`` lists the keys).
    """
    shown, writes, closest, unknown = [], [], [], []
    for token, name, value in flags:
        flag = token.partition("=")[0]
        shown.append(token if value is None or "=" in token else f"{token} {value}")
        keys = closest_keys(name, known)
        if keys and _last(keys[0]) == name:
            writes.append(f"{keys[0]}={'true' if value is None else value}")
        elif keys:  # another name: its meaning or unit may differ (lr_warmup_init vs lr_warmup_iters)
            closest.append(f"the closest key to {flag} is {' or '.join(keys)}")
        else:
            unknown.append(flag)
    what = "not an option" if len(flags) == 1 else "not options"
    parts = [f"{' '.join(shown)}: {what} of {program}, which takes key=value overrides"]
    parts += [f"write {' '.join(writes)}"] if writes else []
    parts += closest + ([f"no key is close to {', '.join(unknown)}"] if unknown else [])
    return "; ".join([*parts, fix])


def hydra_long_options() -> list:
    """Hydra's long command-line options (``--cfg``, ``--multirun``, ...), from the parser `@hydra.main` uses."""
    from hydra._internal.utils import get_args_parser

    return [o for action in get_args_parser()._actions for o in action.option_strings if o.startswith("--")]
