"""Checkpoint integrity: a CRC32 per file in ``manifest.json``, written before publication, verified at load.

``iter_N/manifest.json`` = ``{"algorithm": "crc32", "files": {name: {"bytes": int, "crc32": "8 hex"}}}``
for every other file of the folder (DCP's ``.metadata`` and ``__<rank>_<i>.distcp`` shards, our
``meta.json``). It is written by rank 0 into ``iter_N.tmp`` after every rank wrote its shards and
before the rename and ``latest`` (`mptrain.checkpoint.atomic.publish`), so a published folder always
has it. Each rank checksums the shard files it wrote itself (they are still in its page cache), in
parallel; rank 0 adds ``.metadata`` and ``meta.json``.

Why CRC32 (``zlib.crc32``) and not SHA-256: the threat is bit rot, a truncated copy or a torn write,
not an adversary; CRC32 detects every burst error up to 32 bits and random corruption with
probability 1 - 2^-32, and runs several times faster than hashlib.sha256 per core. The
files are verified at load split across ranks (file i on rank i mod world) before DCP reads them.
Folders saved before manifests existed (no manifest.json) load unverified.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Optional

MANIFEST_FILE = "manifest.json"
_BLOCK = 16 << 20  # bytes per read


def file_crc32(path: Path) -> tuple[int, str]:
    """(size in bytes, CRC32 as 8 lowercase hex digits) of one file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, f"{crc & 0xFFFFFFFF:08x}"


def own_shards(folder: Path, rank: int) -> dict:
    """{name: {"bytes", "crc32"}} of the DCP shard files this rank wrote (``__<rank>_*.distcp``)."""
    out = {}
    for path in sorted(Path(folder).glob(f"__{rank}_*.distcp")):
        size, crc = file_crc32(path)
        out[path.name] = {"bytes": size, "crc32": crc}
    return out


def write_manifest(folder: Path, per_rank: list) -> dict:
    """Rank 0: merge every rank's `own_shards`, add the remaining files, write manifest.json (fsynced)."""
    files: dict = {}
    for part in per_rank:
        files.update(part)
    for path in sorted(Path(folder).iterdir()):
        if path.is_file() and path.name not in files and path.name != MANIFEST_FILE:
            size, crc = file_crc32(path)
            files[path.name] = {"bytes": size, "crc32": crc}
    manifest = {"algorithm": "crc32", "files": files}
    with open(Path(folder) / MANIFEST_FILE, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(folder: Path) -> Optional[dict]:
    """The folder's manifest (None when the folder predates manifests).

    Raises:
        ValueError: manifest.json exists but is not a valid manifest.
    """
    path = Path(folder) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        manifest["files"].items()
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as err:
        raise ValueError(f"{path} is unreadable ({err})") from None
    return manifest


def check_files(folder: Path, names: list, manifest: dict) -> Optional[str]:
    """None when every file in ``names`` matches the manifest, else one line naming the first bad file."""
    for name in names:
        want = manifest["files"][name]
        path = Path(folder) / name
        if not path.is_file():
            return f"{path} is missing"
        size, crc = file_crc32(path)
        if size != want["bytes"]:
            return f"{path} is truncated or padded ({size} bytes, the manifest says {want['bytes']})"
        if crc != want["crc32"]:
            return f"{path} is corrupt (crc32 {crc}, the manifest says {want['crc32']})"
    return None


def verify_folder(folder: Path, rank: int, world_size: int, gather=None) -> Optional[str]:
    """Verify ``folder`` against its manifest, files split over the ranks; the first problem or None.

    Args:
        gather: ``f(obj) -> [obj of every rank]`` (collective); None = a world of one.
    Returns:
        the same value on every rank.
    """
    try:
        manifest = read_manifest(folder)
        problem = None
        if manifest is not None:
            names = sorted(manifest["files"])
            problem = check_files(folder, names[rank::world_size], manifest)
    except ValueError as err:
        manifest, problem = None, str(err)
    problems = gather(problem) if gather is not None else [problem]
    return next((p for p in problems if p), None)
