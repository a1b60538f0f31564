"""The run folder (DESIGN.md §2): resolved on rank 0 and broadcast, config agreement, existing-folder policy.

Order (every rank runs `resolve_run_dir`; it is collective over the default group):
1. Config agreement: every rank hashes its resolved config without `run.dir` and all-gathers the
   hashes; any mismatch raises `ConfigError` on every rank, naming the first differing key and
   the two values (catches per-rank resolvers such as `${oc.env:...}`, hydra#2070).
2. Rank 0 picks the folder — `run.dir`, else `outputs/<model>-<parallel>-<precision>`; in a sweep
   `<root>/<swept keys>` — applies the policy below, creates it, and broadcasts either the absolute
   path or the one-line refusal; every rank then returns the same path or raises the same error.
3. Rank 0 writes `config.yaml` (resolved, with the resolved `run.dir`).

Existing-folder policy: a missing folder is created; an existing empty folder is used; a folder
that already holds a run (config.yaml, metrics.jsonl, layout.json or train.log) is appended to only
when the run resumes from a checkpoint, or when that run is a failed start (no metrics row, no
layout.json: `is_failed_start`), which the new start replaces. Otherwise a folder that holds a run
and was named by the config (the schema default or an experiment YAML, not `run.dir=` on the
command line) gives way to the first free `<dir>-2`, `<dir>-3`, ... (one line on stderr says which
and why; config values inside the folder, such as `checkpoint.save: ${run.dir}/checkpoints`, move
with it), so consecutive fresh runs of one command never collide. Anything else is refused with
one line naming `run.dir`. Nothing is written before `validate_config` passed (it runs first).

A null `run.dir` is set to the planned folder before the config resolves (`with_planned_run_dir`),
so `${run.dir}` never reads `None`. A `checkpoint.save` that already holds checkpoints the run does
not resume from is refused (`checkpoint_save_refusal`): before any collective when it lies outside
`run.dir`, else on rank 0's folder decision, where it lands after a move.
"""

from __future__ import annotations

import copy
import hashlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from mptrain.config.schema import config_to_container
from mptrain.errors import ConfigError

RUN_FILES = ("config.yaml", "metrics.jsonl", "layout.json", "train.log")


def default_run_dir(cfg: Any) -> str:
    """`outputs/<model.name>-<parallel.name>-<precision.name>` (deterministic: same on every rank and rerun)."""
    return f"outputs/{cfg.model.name}-{cfg.parallel.name}-{cfg.precision.name}"


def with_planned_run_dir(cfg: Any, sweep_job: Any = None) -> Any:
    """`cfg` with a null `run.dir` set to the folder the run plans to use, so `${run.dir}` resolves to it.

    The planned folder is the sweep job's `<root>/<subdir>`, else `default_run_dir(cfg)`. Without it
    an interpolation such as `checkpoint.save: ${run.dir}/ckpt` resolves to the text `None/ckpt`.
    The folder may still give way to `<dir>-N` (`resolve_run_dir`): literal paths under it move along.

    Args:
        cfg: the composed config; only a `DictConfig` whose `run.dir` is null is changed (a copy is
            returned, the caller's object is left alone); a resolved `Config` is returned as is.
        sweep_job: the `SweepJob` in a multirun, else None.
    """
    if not isinstance(cfg, DictConfig) or OmegaConf.select(cfg, "run.dir", throw_on_missing=False) not in (None, ""):
        return cfg
    planned = str(sweep_job.dir) if sweep_job is not None else default_run_dir(cfg)
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        OmegaConf.update(cfg, "run.dir", planned, force_add=True)
    return cfg


def follow_checkpoint_model_name(cfg: Any, planned: str) -> None:
    """Rename the planned default folder after `checkpoint.use_checkpoint_args` replaced `model.name`.

    `with_planned_run_dir` names the default folder before the checkpoint's model is known; the
    folder names the model the run builds (`default_run_dir(cfg)`), so `run.dir` and the literal
    paths under the planned folder move there (in place). `checkpoint.load` stays: it was read already.

    Args:
        cfg: the resolved `Config` whose `run.dir` is `planned`.
        planned: the folder `with_planned_run_dir` set.
    """
    new = default_run_dir(cfg)
    if new == planned:
        return
    load = cfg.checkpoint.load
    _move_paths(cfg, (planned, str(Path(planned).resolve())), new)
    cfg.checkpoint.load, cfg.run.dir = load, new


def config_container(cfg: Any) -> dict:
    """The resolved config as plain containers (`Config` schema applied, keys added with ``+`` kept)."""
    return config_to_container(cfg)


def _flatten(node: Any, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out: dict = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def config_fingerprint(cfg: Any) -> tuple[str, dict]:
    """(sha256 hex of the resolved config without run.dir, its flattened {dotted key: value})."""
    container = config_container(cfg)
    container.get("run", {}).pop("dir", None)
    flat = _flatten(container)
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()
    return digest, flat


def check_config_agreement(fingerprints: list) -> None:
    """Raise on every rank when any rank's config hash differs from rank 0's.

    Args:
        fingerprints: `config_fingerprint` of every rank, indexed by rank.
    Raises:
        ConfigError: naming the first differing rank, key and values.
    """
    ref_hash, ref_flat = fingerprints[0]
    for rank, (digest, flat) in enumerate(fingerprints):
        if digest == ref_hash:
            continue
        keys = sorted(k for k in set(ref_flat) | set(flat) if ref_flat.get(k, "<missing>") != flat.get(k, "<missing>"))
        key = keys[0] if keys else "?"
        raise ConfigError(
            f"config: rank {rank}'s resolved config differs from rank 0's at {key} "
            f"(rank 0: {ref_flat.get(key, '<missing>')!r}, rank {rank}: {flat.get(key, '<missing>')!r}"
            f"{f'; {len(keys)} keys differ' if len(keys) > 1 else ''}); give every rank the same overrides and "
            f"environment (no per-rank ${{oc.env:...}})"
        )


def run_dir_decision(path: str | os.PathLike, *, resuming: bool) -> Optional[str]:
    """Apply the existing-folder policy to `path` (no side effects). Returns None if usable, else the refusal."""
    p = Path(path)
    if not p.exists():
        return None
    if not p.is_dir():
        return f"run.dir={p} exists and is not a folder; pick another run.dir="
    entries = sorted(e.name for e in p.iterdir())
    if not entries:
        return None
    run_files = [f for f in RUN_FILES if f in entries]
    if run_files and resuming:
        return None
    if run_files and is_failed_start(p):
        return None
    if run_files:
        return (
            f"run.dir={p} already holds a run ({', '.join(run_files)}) and this run does not resume from a "
            f"checkpoint; pick a new run.dir=, delete the folder, or resume with checkpoint.load="
        )
    return f"run.dir={p} exists, is not empty ({entries[0]}, ...) and is not a run folder; pick an empty or new run.dir="


def holds_run(path: str | os.PathLike) -> bool:
    """`path` is a folder holding a run (one of `RUN_FILES`)."""
    p = Path(path)
    return p.is_dir() and any((p / name).exists() for name in RUN_FILES)


def free_run_dir(path: str | os.PathLike, *, resuming: bool) -> Path:
    """The first of `path`, `<path>-2`, `<path>-3`, ... that `run_dir_decision` accepts (no side effects)."""
    p = Path(path)
    candidate, n = p, 1
    while run_dir_decision(candidate, resuming=resuming) is not None:
        n += 1
        candidate = p.with_name(f"{p.name}-{n}")
    return candidate


def checkpoint_save_refusal(save: Optional[str], load: Optional[str]) -> Optional[str]:
    """The one-line refusal when `checkpoint.save` already holds checkpoints this run does not resume from.

    A fresh run saving there would move `latest` back to its own iteration (pointing at another
    model) and overwrite that run's `iter_N` folders. Resuming means `checkpoint.load` names the same
    folder (the restart pattern `checkpoint.save=D checkpoint.load=D`). No side effects.

    Args:
        save, load: `checkpoint.save` and `checkpoint.load` (null: not set).
    Returns:
        None when `save` is unset, missing, holds no `latest` nor complete `iter_N`, or is the load folder.
    """
    from mptrain.checkpoint.atomic import list_iterations, read_latest

    if not save or (load and Path(load).resolve() == Path(save).resolve()):
        return None
    folder = str(Path(save).resolve())  # `${run.dir}/../ck` before run.dir exists: the folder it will be
    latest, iterations = read_latest(folder), list_iterations(folder)
    if latest is None and not iterations:
        return None
    held = f"latest = iteration {latest}" if latest is not None else f"iterations {iterations[0]} to {iterations[-1]}"
    return (f"checkpoint.save={save} already holds checkpoints ({held}) and this run does not resume from them; "
            f"resume with checkpoint.load={save}, or choose an empty checkpoint.save folder")


def path_inside(path: Optional[str], folder: Path) -> bool:
    """`path` (e.g. ``checkpoint.load``) is `folder` or lies under it."""
    if not path:
        return False
    p, f = Path(path).resolve(), folder.resolve()
    return p == f or f in p.parents


def run_dir_from_command_line() -> bool:
    """`run.dir=` was given on the command line (Hydra's task overrides). Outside a Hydra app (a
    config composed by code) the folder counts as chosen by the caller: True."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True
    overrides = HydraConfig.get().overrides.task
    return any(o.split("=", 1)[0].lstrip("+~") == "run.dir" for o in overrides)


def _spellings(folder: str) -> tuple:
    """A folder as the config may name it: as given and resolved (the `olds` of `_moved_value` / `_move_paths`)."""
    return str(Path(folder)), str(Path(folder).resolve())


def _moved_value(value: Any, olds: tuple, new: str) -> Any:
    """`value` pointed at `new` when it is one of the `olds` folders or lies under one; else None."""
    for old in olds:
        if isinstance(value, str) and value and (value == old or value.startswith(old + "/")):
            return new + value[len(old):]
    return None


def _move_paths(node: Any, olds: tuple, new: str) -> None:
    """Point every string value equal to one of `olds` or under it at `new` instead (in place; each
    value moves once, so `new` may lie inside an old folder, as a sweep job's does).

    Interpolations of a `DictConfig` are left alone: they follow `run.dir` by themselves.
    """
    if isinstance(node, (DictConfig, ListConfig)):
        for key in list(node.keys()) if isinstance(node, DictConfig) else range(len(node)):
            if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
                continue
            child = node[key]
            target = _moved_value(child, olds, new)
            if target is not None:
                node[key] = target
            elif isinstance(child, (DictConfig, ListConfig)):
                _move_paths(child, olds, new)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            child = getattr(node, field.name)
            target = _moved_value(child, olds, new)
            if target is not None:
                setattr(node, field.name, target)
            else:
                _move_paths(child, olds, new)
    elif isinstance(node, (dict, list)):
        for key, child in (node.items() if isinstance(node, dict) else enumerate(node)):
            target = _moved_value(child, olds, new)
            if target is not None:
                node[key] = target
            else:
                _move_paths(child, olds, new)


def is_failed_start(path: Path) -> bool:
    """A folder whose only run is a start that failed before its first iteration was recorded.

    config.yaml is written once the config validated and the folder was agreed, but the start can
    still fail after it (an optimizer rejecting its arguments, a checkpoint of another model, a data
    file, the first step): such a folder has no layout.json and no metrics row, holds nothing
    worth keeping, and the corrected start reuses it (its train.log is appended to).
    """
    names = {e.name for e in path.iterdir()}
    if "config.yaml" not in names or "layout.json" in names or not names <= set(RUN_FILES) | {"config.yaml.tmp"}:
        return False
    metrics = path / "metrics.jsonl"
    return not metrics.exists() or not metrics.read_text().strip()


def _torch_broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _torch_all_gather(obj: Any) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def resolve_run_dir(
    cfg: Any,
    *,
    rank: int,
    world_size: int,
    resuming: bool,
    broadcast_object: Optional[Callable[[Any], Any]] = None,
    all_gather_object: Optional[Callable[[Any], list]] = None,
    sweep_job: Any = None,
    from_command_line: Optional[bool] = None,
) -> Path:
    """Agree on the config and the run folder on every rank; rank 0 creates it and writes config.yaml.

    Collective: every rank of the default group must call it (after `validate_config`).

    Args:
        cfg: the composed config (`DictConfig` or `Config`).
        rank, world_size: this process in the default group.
        resuming: this run resumes from a checkpoint (an existing run folder may be appended to).
        broadcast_object: `f(obj) -> rank 0's obj` on every rank; None = torch.distributed's
            `broadcast_object_list` (identity for a world of 1).
        all_gather_object: `f(obj) -> [obj of rank 0, 1, ...]`; None = `all_gather_object`.
        sweep_job: the `SweepJob` in a multirun (folder `<root>/<subdir>`), else None.
        from_command_line: `run.dir` was named by the user on the command line (such a folder holding
            a run is refused; a folder named by the config gives way to `<dir>-N`); None =
            `run_dir_from_command_line()`.
    Returns:
        the absolute run folder, the same on every rank; when it moved to `<dir>-N`, ``cfg.run.dir``
        and the config's paths under the configured folder are set to it (on every rank).
    Raises:
        ConfigError (on every rank): config mismatch between ranks; the folder refused by the policy.
    """
    import torch.distributed as dist

    if broadcast_object is dist.broadcast_object_list:  # accept torch's list-based function as well
        broadcast_object = _torch_broadcast
    if all_gather_object is dist.all_gather_object:
        all_gather_object = _torch_all_gather
    if world_size == 1:
        broadcast_object = broadcast_object or (lambda obj: obj)
        all_gather_object = all_gather_object or (lambda obj: [obj])
    broadcast_object = broadcast_object or _torch_broadcast
    all_gather_object = all_gather_object or _torch_all_gather

    try:
        check_config_agreement(all_gather_object(config_fingerprint(cfg)))
    except ConfigError as err:
        err.symmetric = True  # every rank compares the same gathered list: rank 0 alone prints the line
        raise

    decision: Optional[tuple] = None
    if rank == 0:
        from mptrain.checkpoint.atomic import checkpoint_exists, save_refusal

        configured, moved_from = None, None
        if sweep_job is not None:
            path = Path(sweep_job.root) / sweep_job.subdir
            # a job writes under its own folder: literal paths inside the configured run.dir (a resolved
            # `${run.dir}/checkpoints`) move with it, or the jobs would share (and overwrite) one folder
            moved_from = cfg.run.dir if cfg.run.dir and Path(cfg.run.dir).resolve() != path.resolve() else None
            if moved_from is not None:  # `${run.dir}/ck` as checkpoint.load: the job resumes from its own folder's
                load = getattr(cfg.checkpoint, "load", None)
                load = _moved_value(load, _spellings(moved_from), str(path.resolve()))
                resuming = resuming or checkpoint_exists(load)
        else:
            configured = cfg.run.dir if cfg.run.dir else default_run_dir(cfg)
            path = Path(configured)
        explicit = run_dir_from_command_line() if from_command_line is None else from_command_line
        if configured is not None and not explicit:
            # a folder the config named is appended to only by a resume from its own checkpoints;
            # resuming from another run's checkpoint is a fresh run here
            resuming = resuming and path_inside(getattr(cfg.checkpoint, "load", None), path)
        refusal = run_dir_decision(path, resuming=resuming)
        if refusal is not None and configured is not None and holds_run(path) and not explicit:
            moved_from, path = configured, free_run_dir(path, resuming=resuming)
            refusal = None
            # a resume from checkpoints outside the config's folder: the fix is the run folder, not checkpoint.load
            hint = ("its checkpoint.load lies outside it: add run.dir=<the folder of that run> to append there"
                    if getattr(cfg.checkpoint, "load", None) else "pick the folder with run.dir=, or resume with "
                    "checkpoint.load=")
            print(f"run.dir: {configured} already holds a run; this run writes to {path} ({hint})",
                  file=sys.stderr, flush=True)
        if refusal is None:
            # checkpoint.save where it will be (moved along with the folder): another run's checkpoints there
            # are refused before anything is written
            olds = _spellings(moved_from) if moved_from is not None else ()
            save, load = (getattr(cfg.checkpoint, key, None) for key in ("save", "load"))
            save = _moved_value(save, olds, str(path.resolve())) or save
            refusal = save_refusal(save) if save and path_inside(save, path) else None  # outside: checked before
            refusal = refusal or checkpoint_save_refusal(save, _moved_value(load, olds, str(path.resolve())) or load)
        if refusal is None:
            path.mkdir(parents=True, exist_ok=True)
        decision = (str(path.resolve()), refusal, moved_from)
    path_str, refusal, moved_from = broadcast_object(decision)
    if refusal is not None:
        err = ConfigError(refusal)
        err.symmetric = True  # rank 0's decision, broadcast: every rank raises this line, rank 0 prints it
        raise err
    run_dir = Path(path_str)
    if moved_from is not None:  # the folder moved: so do the config's paths inside it, alike on every rank
        _move_paths(cfg, _spellings(moved_from), path_str)
        cfg.run.dir = path_str
    if rank == 0:
        write_config(run_dir, cfg)
    return run_dir


def write_config(run_dir: Path, cfg: Any) -> Path:
    """Write `<run_dir>/config.yaml`: the resolved config with `run.dir` set to the folder (atomic rename)."""
    container = config_container(cfg)
    container.setdefault("run", {})["dir"] = str(run_dir)
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_name("config.yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
    os.replace(tmp, path)
    return path
