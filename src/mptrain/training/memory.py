"""`debug.memory_snapshot=true`: record CUDA allocator history during training, dump a pickle on rank 0.

The design document's memory-debugging recipe (PyTorch's memory snapshot, "Understanding CUDA
Memory Usage", pytorch.org/docs/stable/torch_cuda_memory.html):

    torch.cuda.memory._record_memory_history(max_entries=N)   # start recording alloc/free events + stacks
    ... training ...
    torch.cuda.memory._dump_snapshot("memory_snapshot.pickle")  # open at https://pytorch.org/memory_viz
    torch.cuda.memory._record_memory_history(enabled=None)     # stop recording

Only global rank 0 records and dumps (one file, `<run.dir>/memory_snapshot.pickle`): recording
costs host time per allocation, and one rank's timeline is what the viewer shows. Rank 0 holds
the first pipeline stage (the embedding, and the most in-flight micro-batches under 1F1B), usually
the stage with the highest peak. On a CPU run the option logs one line and does nothing.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

SNAPSHOT_FILE = "memory_snapshot.pickle"
CPU_MESSAGE = "debug.memory_snapshot: CUDA only (this run is on {device}); no snapshot is recorded"


@contextlib.contextmanager
def memory_snapshot(
    enabled: bool,
    *,
    device: torch.device,
    run_dir: Path,
    rank: int,
    log: Callable[[str], None],
    max_entries: int = 100_000,
) -> Iterator[Optional[Path]]:
    """Record the CUDA allocator's history inside the block; on exit dump it to `run_dir` on rank 0.

    The dump also happens when the block raises (an out-of-memory error is the usual reason to
    ask for a snapshot); a failing dump is logged and never hides the block's own exception.

    Args:
        enabled: `debug.memory_snapshot`.
        device: this rank's compute device; anything but CUDA logs `CPU_MESSAGE` once and records nothing.
        run_dir: the run folder (rank 0 writes `SNAPSHOT_FILE` there).
        rank: global rank (only rank 0 records and dumps).
        log: rank 0's log line function (`Recorder.log`; a no-op elsewhere).
        max_entries: allocator events kept (a ring buffer; older events are dropped).
    Yields:
        the snapshot path on the recording rank, else None.
    """
    if not enabled:
        yield None
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        log(CPU_MESSAGE.format(device=device.type))
        yield None
        return
    if rank != 0:
        yield None
        return
    path = Path(run_dir) / SNAPSHOT_FILE
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield path
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
            log(f"debug.memory_snapshot: wrote {path} (open it at https://pytorch.org/memory_viz)")
        except Exception as err:  # noqa: BLE001 - a debugging aid must not replace the run's own error
            log(f"debug.memory_snapshot: could not write {path}: {type(err).__name__}: {err}")
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
