"""Checkpoints: save / load with torch.distributed.checkpoint, resharding across layouts (DESIGN.md §4).

Public entry points (called by `mptrain.training.checkpointing`), on this rank's `TrainState` (model
chunks, optimizer wrapper, LR scheduler, RNG tracker, iteration, consumed samples):
    save_checkpoint(state, *, cfg, groups, log, before_write) -> Path | None   (collective, blocking)
    maybe_load_checkpoint(state, *, cfg, groups, log) -> None   (collective; fills state in place)
    capture_save(state, *, cfg, groups) -> PendingSave | None, then writer.stage_to_host /
        writer.write_and_publish: an async save, run on a thread of the caller's
Module map: api (the entry points), state (`TrainState`; what is saved, by global key), writer (write,
checksums, publication), reshard (local tensor → global boxes), dcp_io (DCP planners), atomic
(folders, `latest`, pruning), rng (per-rank RNG), offline (a checkpoint read or written in one process
without torch.distributed: `mptrain.generate`, `mptrain.export`, `mptrain.hf`).
"""

from mptrain.checkpoint.api import capture_save, maybe_load_checkpoint, save_checkpoint
from mptrain.checkpoint.state import TrainState

__all__ = ["TrainState", "capture_save", "maybe_load_checkpoint", "save_checkpoint"]
