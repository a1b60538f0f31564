"""The distributed optimizer's parameter all-gather, at once or overlapped with the next forward.

Megatron-LM ``distributed/param_and_grad_buffer.py`` (``start_param_sync`` / ``finish_param_sync`` of a
bucket group) and ``distributed_data_parallel.py`` (the forward pre-hooks of ``--overlap-param-gather``).

After a ZeRO-1 step each DP rank holds the updated values of its 1/dp of every bucket
(`mptrain.distributed.DistributedOptimizer` writes them into a bucket-sized scratch, in the grad buffer's
dtype, at the bucket's offsets). `ParamGather.start` all-gathers that scratch over DP and copies it into
the bucket's params:

* ``overlap=False``: at once (the all-gather, then the copies), inside the optimizer step;
* ``overlap=True`` (``parallel.overlap_param_gather``): the all-gather is launched asynchronously and left
  pending; a forward pre-hook of the first module that uses one of the bucket's params waits for it and
  copies, so the buckets the forward reaches late arrive while the early layers compute. The modules are
  the model's `mptrain.layers.param_use.ParamUseRegions` (eager pre-hooks, in forward order); params
  outside them are waited for when the chunk's forward starts (`finish_unhooked`). Anything else that
  reads the params calls `finish_all` first: evaluation, a checkpoint save, the FP8 weight casts, the
  end of training (Megatron's ``disable_forward_pre_hook(param_sync=True)``).

The values copied are the same either way (one all-gather of the same scratch), so the two modes train
bitwise alike. A bucket never has two all-gathers in flight: `start` lands a pending one first (a bucket
whose params no forward used since the last step).

Memory: while pending, each bucket keeps its scratch (the bucket's size in the buffer's dtype) and this
rank's shard of it (1/dp), from the step to the bucket's first use: at most the model's size in the
buffer's dtype, where the synchronous gather holds one bucket's at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from mptrain.distributed.grad_buffer import Bucket, GradBuffer
from mptrain.errors import ConfigError
from mptrain.layers.param_use import ParamUseRegions

# torch >= 2.10 renamed the tensor collectives (the old names warn); accept both.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_overlap_param_gather(parallel) -> None:
    """``parallel.overlap_param_gather`` needs the distributed optimizer and ``overlap_grad_reduce`` (Megatron's
    rules in ``megatron/training/arguments.py``: "--overlap-param-gather only supported with distributed
    optimizer", "Must use --overlap-param-gather with --overlap-grad-reduce"). Pure.

    Raises:
        ConfigError: one line naming the missing key(s) and the fix.
    """
    if not parallel.overlap_param_gather:
        return
    missing = [key for key, on in (("parallel.use_distributed_optimizer", parallel.use_distributed_optimizer),
                                   ("parallel.overlap_grad_reduce", parallel.overlap_grad_reduce)) if not on]
    if missing:
        raise ConfigError(f"parallel.overlap_param_gather=true overlaps the distributed optimizer's param all-gather "
                          f"with the next forward (as Megatron, together with the grad reduction's overlap); set "
                          f"{' and '.join(f'{k}=true' for k in missing)}, or parallel.overlap_param_gather=false")


@dataclasses.dataclass
class _Pending:
    """One bucket's launched all-gather: ``work`` fills ``scratch`` from every rank's ``shard`` (kept alive until then)."""

    work: Optional[dist.Work]
    scratch: torch.Tensor
    shard: torch.Tensor
    buffer: GradBuffer
    bucket: Bucket


class ParamGather:
    """The parameter all-gathers of one DDP chunk's buckets (see the module docstring).

    Args:
        buffers: the chunk's grad buffers (their bucket layout and param slots), indexed as ``start``'s ``buffer``.
        groups: `ParallelGroups` (each buffer's `GradBuffer.reduction`: DP, or expert-DP).
        overlap: leave the all-gathers pending until the params are used (``parallel.overlap_param_gather``).
    """

    def __init__(self, buffers: tuple, groups, *, overlap: bool) -> None:
        self.buffers, self.groups, self.overlap = buffers, groups, overlap
        self._pending: dict = {}  # (buffer index, bucket index) -> _Pending
        self._unhooked: list = []  # the keys `finish_unhooked` waits for (no region holds one of their params)

    def start(self, buffer: int, bucket: Bucket, scratch: torch.Tensor) -> None:
        """All-gather ``scratch`` (``bucket.numel`` elements of buffer ``buffer``'s dtype, this rank's shard
        filled) over DP into every rank's copy, then copy it into the bucket's params: now, or with ``overlap``
        when first used. Collective over DP: every rank calls it for the same buckets in the same order."""
        key = (buffer, bucket.index)
        self.finish(key)
        buf = self.buffers[buffer]
        group, rank, size = buf.reduction(self.groups)  # DP, or expert-DP for expert weights
        if size == 1:  # nothing to gather
            self._copy(buf, bucket, scratch)
            return
        lo, hi = bucket.shard_range(rank, size)
        shard = scratch[lo - bucket.start : hi - bucket.start].clone()  # the collective's input may not alias its output
        work = _all_gather(scratch, shard, group=group, async_op=self.overlap)
        if self.overlap:
            self._pending[key] = _Pending(work, scratch, shard, buf, bucket)
        else:
            self._copy(buf, bucket, scratch)

    def finish(self, key: tuple) -> None:
        """Wait for bucket ``key``'s all-gather and copy it into its params; nothing when none is pending."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        if pending.work is not None:
            pending.work.wait()
        self._copy(pending.buffer, pending.bucket, pending.scratch)

    def finish_all(self) -> None:
        """Every pending all-gather landed in the params (before anything reads them outside a forward)."""
        for key in list(self._pending):
            self.finish(key)

    def finish_unhooked(self) -> None:
        """The buckets no region's pre-hook waits for (called as the chunk's forward starts)."""
        for key in self._unhooked:
            self.finish(key)

    @property
    def pending(self) -> list:
        """Keys (buffer index, bucket index) of the all-gathers launched and not yet copied (tests, debugging)."""
        return list(self._pending)

    def install_hooks(self, model: torch.nn.Module) -> list:
        """Forward pre-hooks on ``model``'s regions (`ParamUseRegions`, when it implements it) that wait for the
        buckets of their params; the buckets of params outside every region go to `finish_unhooked`.
        Returns the hook handles."""
        key_of = {}
        for b, buf in enumerate(self.buffers):
            for param in buf.params():
                key_of[param] = (b, buf.slot(param).bucket)
        regions = model.param_use_regions() if isinstance(model, ParamUseRegions) else []
        handles, covered = [], set()
        for region in regions:
            keys = tuple(dict.fromkeys(key_of[p] for p in region.parameters() if p in key_of))
            covered.update(p for p in region.parameters() if p in key_of)
            if keys:
                handles.append(region.register_forward_pre_hook(self._hook(keys)))
        self._unhooked = list(dict.fromkeys(k for p, k in key_of.items() if p not in covered))
        return handles

    def _hook(self, keys: tuple):
        def wait_for_params(module, args) -> None:
            for key in keys:
                self.finish(key)

        return wait_for_params

    @staticmethod
    @torch.no_grad()
    def _copy(buf: GradBuffer, bucket: Bucket, scratch: torch.Tensor) -> None:
        for param in buf.bucket_params(bucket):
            slot = buf.slot(param)
            param.data.view(-1).copy_(scratch[slot.start - bucket.start : slot.end - bucket.start])
