"""The disk side of a save: one captured iteration (`PendingSave`) written, checksummed and published.

`mptrain.checkpoint.api.capture_save` makes the `PendingSave` (references to the live tensors);
`write_and_publish` writes it (collective over the given group): ``iter_N.tmp`` → DCP shards →
CRC32 manifest + meta.json → rename to ``iter_N``, ``latest``, pruning (`mptrain.checkpoint.atomic`).
A blocking save calls it on the main thread (`mptrain.checkpoint.api.save_checkpoint`); an async
save first copies the tensors to host memory (`stage_to_host`) and calls it from a thread of the
caller's, over a process group of its own. A failed write on any rank is one `StorageError` on
every rank (`_save_error`), ``iter_N.tmp`` removed and the previous checkpoint untouched.

Importing this module imports torch.distributed.checkpoint (0.5 s, DTensor included): callers import
it at the start of a save, on the main thread, never in an async save's thread.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mptrain.checkpoint import atomic, dcp_io, integrity
from mptrain.checkpoint.args import keep_tokenizer_copy
from mptrain.errors import StorageError

FULL_DISK_BYTES = 1 << 20  # a failed save with less free space than this on checkpoint.save is reported as a full disk
META_KEYS = ("format", "iteration", "consumed_samples", "layout", "vocab_size", "param_dtype", "torch_version",
             "config")  # the parts of the common object that meta.json repeats (readable without DCP)


@dataclasses.dataclass(frozen=True)
class PendingSave:
    """One iteration's state on its way to ``root/iter_N``.

    Args:
        root: ``checkpoint.save``.
        iteration: N.
        chunks: this rank's tensor boxes (`mptrain.checkpoint.reshard.Chunk`: model, main params,
            optimizer state), views of the live tensors until `stage_to_host` copies them.
        objects: the pickled objects: ``common`` (`mptrain.checkpoint.state`), this rank's
            ``rng/...``, the optimizer's scalar state.
        keep_last_n: ``checkpoint.keep_last_n`` (None: keep all).
        tokenizer: ``data.tokenizer`` (its file is copied beside the checkpoints: `keep_tokenizer_copy`).
    """

    root: str
    iteration: int
    chunks: list
    objects: dict
    keep_last_n: Optional[int]
    tokenizer: Any

    @property
    def folder(self) -> Path:
        """Where the checkpoint is published."""
        return Path(self.root) / atomic.iter_dir_name(self.iteration)


def stage_to_host(save: PendingSave, buffers: dict) -> PendingSave:
    """``save`` with its tensors and objects copied to host memory: what an async save writes while training
    goes on. The only part of an async save that blocks the loop (the device-to-host copy).

    Device tensors go into page-locked host buffers kept in ``buffers`` across saves (keyed by position,
    shape and dtype: the caller keeps the dict) and copied with one stream sync at the end: allocating and
    faulting in pageable memory at every save would block the loop many times longer
    (bench/reports/2026-12-01-micro-benchmarks.md). Reuse is safe only once the previous save that read
    them has finished: the caller waits for it first."""
    staged, on_device = [], False
    for i, c in enumerate(save.chunks):
        view = c.view.detach()
        if view.device.type == "cpu":
            host = view.clone()  # the loop keeps updating the params in place
        else:
            key = (i, tuple(view.shape), view.dtype)
            host = buffers.get(key)
            if host is None:
                host = buffers[key] = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
            host.copy_(view, non_blocking=True)
            on_device = True
        staged.append(dataclasses.replace(c, view=host))
    if on_device:
        torch.cuda.synchronize()  # the non-blocking copies above must land before the writer thread reads them
    return dataclasses.replace(save, chunks=staged, objects=copy.deepcopy(save.objects))


def _all_ok(ok: bool, device, group=None) -> bool:
    """MIN over all ranks of a success flag (so a failure on rank 0 raises everywhere, never hangs)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def write_and_publish(save: PendingSave, *, rank: int, world_size: int, device: torch.device, group=None,
                      before_write: Optional[Callable[[], None]] = None) -> str:
    """Write ``save`` and publish it (collective over ``group``, None = the default group): tmp folder, DCP
    write, checksums, meta.json + manifest, rename, ``latest``, pruning.

    Args:
        rank, world_size: this rank in ``group`` and its size.
        device: where the success flags are reduced (``cpu`` for a gloo group).
        before_write: called once ``iter_N.tmp`` exists, before the DCP write (a fault site of the caller's).
    Returns:
        the log line: "checkpoint: saved iteration N to <folder>" (+ the folders pruned).
    Raises:
        StorageError: a write failed on any rank: raised on every rank, one line naming the folder,
            the cause and the fix; ``iter_N.tmp`` is removed, the previous checkpoint and ``latest``
            are untouched.
    """
    root, iteration = save.root, save.iteration
    tmp = atomic.tmp_dir(root, iteration)
    ok, error = True, None
    if rank == 0:
        try:
            atomic.prepare_tmp(root, iteration)
        except OSError as err:
            ok, error = False, err
    if not _all_ok(ok, device, group):
        raise _save_error(root, iteration, tmp, error)
    if before_write is not None:
        before_write()
    shards = None
    try:
        dcp_io.save_chunks(str(tmp), save.chunks, save.objects, process_group=group)
        shards = integrity.own_shards(tmp, rank)  # this rank's files, checksummed in parallel
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException (a BaseException) holds every rank's error
        ok, error = False, err
    # DCP raises alike on every rank when one rank's write failed; the flag makes sure of it
    if not _all_ok(ok, device, group):
        raise _save_error(root, iteration, tmp, error)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, shards, group=group)
    removed = []
    if rank == 0:
        try:
            common = save.objects["common"]
            atomic.write_json(tmp / atomic.META_FILE, {k: common[k] for k in META_KEYS})
            integrity.write_manifest(tmp, gathered)  # before the rename and `latest`
            keep_tokenizer_copy(save.tokenizer, Path(root))  # the checkpoint decodes without the run's file
            removed = atomic.publish(root, iteration, save.keep_last_n)
        except OSError as err:
            ok, error = False, err
    if not _all_ok(ok, device, group):
        raise _save_error(root, iteration, tmp, error)
    return (f"checkpoint: saved iteration {iteration} to {save.folder}"
            + (f" (removed iterations {removed}: keep_last_n={save.keep_last_n})" if removed else ""))


def _root_oserror(err: BaseException) -> Optional[OSError]:
    """The OSError behind ``err`` (DCP's CheckpointException keeps each rank's exception in ``failures``)."""
    seen = 0
    stack = [err]
    while stack and seen < 50:
        e = stack.pop()
        seen += 1
        if isinstance(e, OSError):
            return e
        for inner in getattr(e, "failures", {}).values() if isinstance(getattr(e, "failures", None), dict) else ():
            stack.append(inner[0] if isinstance(inner, tuple) else inner)
        for inner in (getattr(e, "__cause__", None), getattr(e, "__context__", None)):
            if inner is not None:
                stack.append(inner)
    return None


def _save_error(root: str, iteration: int, tmp: Path, error: Optional[BaseException]) -> StorageError:
    """Rank 0 removes ``iter_N.tmp``; every rank gets the same one-line `StorageError`.

    The message comes from what every rank knows (rank 0 alone prints it): the folder, the
    previous checkpoint, and the cause when this rank saw it.
    """
    free = None
    try:  # before removing the .tmp: torch's zip writer hides ENOSPC ("unexpected pos ..."), the free space does not
        free = shutil.disk_usage(root).free
    except OSError:
        pass
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            Path(root, "latest.tmp").unlink(missing_ok=True)
        except OSError:  # root itself unusable (under a file, unreadable): the message below says so
            pass
    os_err = _root_oserror(error) if error is not None else None
    if (os_err is not None and os_err.errno == errno.ENOSPC) or (free is not None and free < FULL_DISK_BYTES):
        cause, fix = "no space left on device", "free space there or point checkpoint.save= at a folder with room"
    elif os_err is not None and os_err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause, fix = f"not writable ({os_err.strerror})", "fix its permissions or point checkpoint.save= elsewhere"
    elif os_err is not None:
        cause, fix = os_err.strerror or str(os_err), "check the storage or point checkpoint.save= elsewhere"
    else:
        cause, fix = "a write failed on another rank", "check that rank's storage or point checkpoint.save= elsewhere"
    previous = atomic.read_latest(root)
    kept = f"the previous checkpoint (iteration {previous}) is intact" if previous is not None else "no earlier checkpoint"
    msg = (f"checkpoint.save={root}: saving iteration {iteration} failed: {cause}; {tmp.name} removed and {kept}; "
           f"{fix}")
    return StorageError(msg, all_ranks=True)


__all__ = ["PendingSave", "stage_to_host", "write_and_publish", "FULL_DISK_BYTES"]
