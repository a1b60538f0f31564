"""Checkpoint folders on disk: names, atomic publication, ``latest``, pruning (DESIGN.md §4).

Layout of ``checkpoint.save``::

    iter_0000004/          .metadata, __<rank>_0.distcp (DCP), meta.json (rank 0)
    iter_0000008/
    latest                 "8\\n" — written last

Publication order (a save killed at any moment leaves the previous checkpoint loadable):
1. every rank writes into ``iter_0000008.tmp/`` (a stale one from a killed save is removed first);
2. rank 0 fsyncs and renames it to ``iter_0000008/`` (an existing folder of that iteration is first
   renamed to ``iter_0000008.old`` and removed after);
3. rank 0 writes ``latest.tmp``, fsyncs, and ``os.replace``s it onto ``latest`` (atomic on POSIX);
4. rank 0 removes folders beyond ``checkpoint.keep_last_n``, counting those up to the iteration just saved
   (oldest first; never that one; later folders, left by a run a resume rewound, stay until passed).
A reader trusts a folder only when it has DCP's ``.metadata`` and ``meta.json`` (written before
the rename); if ``latest`` names a folder that is not complete it falls back to the newest
complete one (`resolve_load_dir`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
META_FILE = "meta.json"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's ``latest`` (its ``iter_N`` folders are named as ours): `load_refusal` sends such a folder to the import."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def tmp_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"{iter_dir_name(iteration)}.tmp"


def is_complete(folder: Path) -> bool:
    """A published checkpoint folder: DCP metadata and our meta.json are both there."""
    return (folder / ".metadata").is_file() and (folder / META_FILE).is_file()


def list_iterations(root: str) -> list:
    """Iterations of the complete checkpoint folders under ``root``, ascending."""
    out = []
    path = Path(root)
    if not path.is_dir():
        return out
    for child in path.iterdir():
        m = _ITER_RE.match(child.name)
        if m and child.is_dir() and is_complete(child):
            out.append(int(m.group(1)))
    return sorted(out)


def checkpoint_exists(load_dir: Optional[str]) -> bool:
    """Whether `checkpoint.load` points at a folder with a `latest` checkpoint (the run then resumes)."""
    return bool(load_dir) and (Path(load_dir) / "latest").exists()


def read_latest(root: str) -> Optional[int]:
    """The iteration in ``root/latest`` (None when missing or unreadable)."""
    try:
        return int(Path(root, "latest").read_text().strip())
    except (OSError, ValueError):
        return None


def resolve_load_dir(root: str, iteration: Optional[int] = None) -> tuple[Optional[Path], Optional[str]]:
    """The folder to load from ``root``: ``iteration`` if given, else ``latest``.

    Returns:
        (folder or None when ``root`` holds no checkpoint, a note for the log or None).
    Raises:
        FileNotFoundError: ``iteration`` was asked for and is not a complete checkpoint.
    """
    if iteration is not None:
        folder = Path(root) / iter_dir_name(iteration)
        if not is_complete(folder):
            have = list_iterations(root)
            raise FileNotFoundError(
                f"checkpoint.load_iteration={iteration}: {folder} is not a complete checkpoint "
                f"(complete iterations in {root}: {have or 'none'})"
            )
        return folder, None
    latest = read_latest(root)
    if latest is not None and is_complete(Path(root) / iter_dir_name(latest)):
        return Path(root) / iter_dir_name(latest), None
    have = list_iterations(root)
    if not have:
        return None, None
    note = f"checkpoint: {root}/latest names iteration {latest}, which is not complete; loading iteration {have[-1]}"
    return Path(root) / iter_dir_name(have[-1]), note


def load_refusal(root: str, iteration: Optional[int], save: Optional[str] = None) -> Optional[str]:
    """Why ``checkpoint.load=root`` (with ``checkpoint.load_iteration=iteration``) cannot resume, as one line, or
    None. A resume reads the folder that holds the ``iter_N`` folders and ``latest``; pointed elsewhere it
    would load nothing and train a fresh run. Refused: ``root`` is one iteration's folder or a file (its
    ``latest``); ``iteration`` is not complete there; ``root`` is a Megatron-LM checkpoint, ``save`` or not
    (mptrain reads it once imported); ``root`` does not exist or holds no complete checkpoint, and is not
    ``save`` (the folder this run saves to, where loading nothing is a restartable job's first start)."""
    path = Path(root)
    is_save = bool(save) and Path(save).resolve() == path.resolve()
    m = _ITER_RE.match(path.name)
    if m and is_complete(path):
        return (f"checkpoint.load={root} is the checkpoint of one iteration, not a checkpoint folder; load it as "
                f"checkpoint.load={path.parent} checkpoint.load_iteration={int(m.group(1))}")
    if path.is_file():
        return (f"checkpoint.load={root} is a file; point it at the folder that holds the iter_* folders and latest"
                f" (checkpoint.load={path.parent})")
    if not path.is_dir():
        return None if is_save else (f"checkpoint.load={root} does not exist; fix the path, or set checkpoint.load "
                                     "to the checkpoint.save folder to resume when it exists and start fresh otherwise")
    if (path / MEGATRON_TRACKER).is_file() and not list_iterations(root):
        # Megatron's iter_N folders look like ours; loading nothing here would train a fresh run beside them
        return (f"checkpoint.load={root} is a Megatron-LM checkpoint ({MEGATRON_TRACKER}); import it once with "
                f"python -m mptrain.export --import-megatron {root} --output CKPT, then set checkpoint.load=CKPT")
    if iteration is not None:
        try:
            resolve_load_dir(root, iteration)
        except FileNotFoundError as err:
            return str(err)
    if is_save or resolve_load_dir(root)[0] is not None:
        return None
    inner = [c for c in sorted(path.iterdir()) if c.is_dir() and list_iterations(str(c))]  # e.g. <run>/checkpoints
    where = f"checkpoint.load={inner[0]}" if inner else "a checkpoint.save folder"
    return (f"checkpoint.load={root} holds no complete checkpoint; point it at {where}, or at this run's "
            "checkpoint.save folder to resume when it holds one and start fresh otherwise")


def save_refusal(save: str) -> Optional[str]:
    """Why ``checkpoint.save=save`` cannot be written, as one line, or None; checked at start-up, so a run
    does not train until its first save to find out. Refused: ``save`` is a file; the nearest existing folder
    on its path is a file (``afile/ck``) or not writable by this process (``os.access``: no write is made)."""
    path = Path(save)
    if path.exists() and not path.is_dir():
        return f"checkpoint.save={save} is a file, not a folder; pick another checkpoint.save"
    ancestor = path.absolute()
    while not ancestor.exists():  # the save creates the missing folders below the nearest existing one
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"checkpoint.save={save}: {ancestor} is a file, not a folder; pick another checkpoint.save"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return (f"checkpoint.save={save}: {ancestor} is not writable by this user; fix its permissions or point "
                "checkpoint.save= elsewhere")
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj) -> None:
    """Write JSON and fsync it (the file is part of what the rename publishes)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())


def prepare_tmp(root: str, iteration: int) -> Path:
    """Rank 0: create ``root`` and an empty ``iter_N.tmp`` (removing a stale one)."""
    tmp = tmp_dir(root, iteration)
    Path(root).mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def publish(root: str, iteration: int, keep_last_n: Optional[int]) -> list:
    """Rank 0, after every rank wrote ``iter_N.tmp``: rename, update ``latest``, prune.

    ``keep_last_n`` counts the folders up to ``iteration``: the newest N of them stay. Folders of a later
    iteration were left by the run a resume rewound (``checkpoint.load_iteration``): they stay until this
    run saves the same iteration (which replaces it) or passes them.

    Returns:
        the iterations removed by ``keep_last_n``.
    """
    root_path = Path(root)
    tmp = tmp_dir(root, iteration)
    final = root_path / iter_dir_name(iteration)
    for child in tmp.iterdir():  # FileSystemWriter fsyncs its files; make sure of ours too
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if final.exists():
        old = root_path / f"{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root_path)
    latest_tmp = root_path / "latest.tmp"
    with open(latest_tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, root_path / "latest")
    _fsync_dir(root_path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    removed = []
    if keep_last_n is not None and keep_last_n > 0:
        have = [it for it in list_iterations(root) if it <= iteration]  # this run's line, `iteration` the newest
        for it in have[: max(0, len(have) - keep_last_n)]:
            shutil.rmtree(root_path / iter_dir_name(it), ignore_errors=True)
            removed.append(it)
    return removed
