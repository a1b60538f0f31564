"""Checkpoints: save / load with torch.distributed.checkpoint, resharding across layouts (DESIGN.md §4).

Public entry points (called by `mptrain.training.run`):
    save_checkpoint(built, *, iteration, consumed_samples, recorder) -> Path | None   (collective)
    maybe_load_checkpoint(built, recorder) -> {"iteration": int, "consumed_samples": int}  (collective)
Module map: api (the two calls), state (what is saved, by global key), reshard (local tensor →
global boxes), dcp_io (DCP planners), atomic (folders, `latest`, pruning), rng (per-rank RNG).
Export / import of consolidated weights: `mptrain.export`.
"""

from mptrain.checkpoint.api import maybe_load_checkpoint, save_checkpoint

__all__ = ["maybe_load_checkpoint", "save_checkpoint"]
