"""Claiming the planned run folder, once the run has validated and built (DESIGN.md §2).

`claim_run_dir` is collective over the default group (every rank calls it):
1. Config agreement: every rank hashes its resolved config without `run.dir` and all-gathers the hash
   and its planned folder; any mismatch raises `ConfigError` on every rank, naming the first differing
   key and the two values (catches per-rank resolvers such as `${oc.env:...}`, hydra#2070).
2. Rank 0 checks the planned folder again (another run may have taken it since the plan), prints the
   plan's move line, creates the folder and broadcasts it or the refusal; every rank then returns the
   same path or raises the same error.
3. Rank 0 writes `config.yaml` (resolved, `run.dir` the absolute folder).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from mptrain.config.schema import config_to_container
from mptrain.errors import ConfigError
from mptrain.runs.folder import RunDirPlan, run_dir_decision
from mptrain.runs.relaunch import flatten


def config_fingerprint(cfg: Any) -> tuple[str, dict]:
    """(sha256 hex of the resolved config without run.dir, its flattened {dotted key: value})."""
    container = config_to_container(cfg)
    container.get("run", {}).pop("dir", None)
    flat = flatten(container)
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


def _check_planned_alike(folders: list) -> None:
    """Every rank planned rank 0's folder (`folders`: each rank's `run.dir`)."""
    for rank, folder in enumerate(folders):
        if folder != folders[0]:
            raise ConfigError(f"run.dir: rank {rank} planned {folder}, rank 0 {folders[0]} (another run was creating "
                              "folders as this one started); start again, or pick the folder with run.dir=")


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


def claim_run_dir(
    cfg: Any,
    plan: RunDirPlan,
    *,
    rank: int,
    world_size: int,
    broadcast_object: Optional[Callable[[Any], Any]] = None,
    all_gather_object: Optional[Callable[[Any], list]] = None,
) -> Path:
    """Agree on the config, create the planned folder (rank 0) and write its config.yaml (rank 0).

    Collective: every rank of the default group calls it, once the run has validated and built, so a
    start that fails before it leaves nothing behind (no folder, no move line).

    Args:
        cfg: the resolved config (`mptrain.runs.folder.planned_config`: its `run.dir` is `plan.dir`).
        plan: this rank's `RunDirPlan`.
        rank, world_size: this process in the default group.
        broadcast_object: `f(obj) -> rank 0's obj` on every rank; None = torch.distributed's
            `broadcast_object_list` (identity for a world of 1).
        all_gather_object: `f(obj) -> [obj of rank 0, 1, ...]`; None = `all_gather_object`.
    Returns:
        the absolute run folder, the same on every rank.
    Raises:
        ConfigError (``symmetric``, on every rank): config mismatch between ranks; the folder refused.
    """
    if world_size == 1:
        broadcast_object = broadcast_object or (lambda obj: obj)
        all_gather_object = all_gather_object or (lambda obj: [obj])
    broadcast_object = broadcast_object or _torch_broadcast
    all_gather_object = all_gather_object or _torch_all_gather

    gathered = all_gather_object((config_fingerprint(cfg), str(cfg.run.dir)))
    try:
        check_config_agreement([fingerprint for fingerprint, _ in gathered])
        _check_planned_alike([folder for _, folder in gathered])
    except ConfigError as err:
        err.symmetric = True  # every rank compares the same gathered list: rank 0 alone prints the line
        raise

    decision: Optional[tuple] = None
    if rank == 0:
        refusal = run_dir_decision(plan.dir, resuming=plan.resuming)
        if refusal is None:
            if plan.move_line is not None:
                print(plan.move_line, file=sys.stderr, flush=True)
            Path(plan.dir).mkdir(parents=True, exist_ok=True)
        decision = (str(Path(plan.dir).resolve()), refusal)
    path, refusal = broadcast_object(decision)
    if refusal is not None:
        err = ConfigError(refusal)
        err.symmetric = True  # rank 0's decision, broadcast: every rank raises this line, rank 0 prints it
        raise err
    if rank == 0:
        write_config(Path(path), cfg)
    return Path(path)


def write_config(run_dir: Path, cfg: Any) -> Path:
    """Write `<run_dir>/config.yaml`: the resolved config with `run.dir` set to the folder (atomic rename)."""
    container = config_to_container(cfg)
    container.setdefault("run", {})["dir"] = str(run_dir)
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_name("config.yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
    os.replace(tmp, path)
    return path
