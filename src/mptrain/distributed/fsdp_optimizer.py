"""The optimizer wrapper of ZeRO-2 / ZeRO-3 (`mptrain.distributed.fsdp`): it steps FSDP's fp32 shards in place.

Each model param is a DTensor sharded on dim 0 over DP (dp × cp with context parallelism); this rank holds rows
``[r0, r1)`` of the TP-local tensor, i.e. elements ``[lo, hi) = [r0·inner, r1·inner)`` of it flattened
(``inner`` = product of the other dims). The wrapper's main param for it is a flat fp32 Parameter that *aliases*
that local shard, so:

* the inner optimizer's step writes the new values straight into FSDP's sharded params (fp32 master weights
  at no extra memory); the next forward's all-gather casts them to the compute dtype;
* the main grad is the local shard of the DP-reduced grad (fp32: ``reduce_dtype``), flattened;
* the entry carries ``flat_range = (lo, hi)`` as a ZeRO-1 piece does, so the checkpoint addresses main params and
  optimizer state by the same global boxes (`mptrain.checkpoint.reshard.flat_piece_chunks`) under any strategy.

Statistics (`OptimizerWrapper`): the DP shards of one param are distinct elements, so found_inf (MAX), the grad
norm and the zero count are reduced over the shard group (``groups.dp_shard_group``: dp × cp, or HSDP's S of them;
the replicas hold the same shards again) and then over the model-parallel group (TP × PP), which tile the world:
every element counts once (TP-replicated params on TP rank 0 only, `ShardSpec.counts_on`). With a loss scaler
every rank therefore skips the same steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from mptrain.precision.optimizer import MainParamEntry, OptimizerWrapper

__all__ = ["FullyShardedOptimizer", "LocalShardEntry", "local_shard"]


def local_shard(param) -> tuple:
    """(local tensor, lo, hi): this rank's shard of a dim-0-sharded DTensor ``param`` and the flat element range
    ``[lo, hi)`` of the TP-local (the DTensor's global) tensor it holds. A plain tensor: (itself, 0, numel)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param.detach(), 0, param.numel()
    with torch.no_grad():
        local = param.to_local()
    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    inner = math.prod(param.shape[1:]) if param.dim() > 1 else 1
    lo = offsets[0] * inner if param.dim() > 0 else 0
    return local, lo, lo + local.numel()


@dataclasses.dataclass
class LocalShardEntry(MainParamEntry):
    """``main``: a flat fp32 Parameter aliasing this rank's shard of ``model_param`` (elements [lo, hi) of the
    flattened TP-local tensor)."""

    lo: int
    hi: int

    @property
    def flat_range(self) -> Optional[tuple]:
        return (self.lo, self.hi)


class FullyShardedOptimizer(OptimizerWrapper):
    """`OptimizerWrapper`'s step over the local fp32 shards of `FullyShardedDataParallel` chunks (module docstring).

    Args:
        build_optimizer: ``param_groups -> torch.optim.Optimizer``.
        model_chunks: this rank's `FullyShardedDataParallel` chunks.
        groups: `ParallelGroups`.
        scaler, clip_grad, max_consecutive_skips, log_num_zeros: as `OptimizerWrapper`.
    Raises:
        ValueError: a chunk is not sharded with FSDP, or a sharded param is not fp32.
    """

    def __init__(self, build_optimizer: Callable, model_chunks: list, groups, *, scaler=None, clip_grad: float = 0.0,
                 max_consecutive_skips: int = 0, log_num_zeros: bool = False) -> None:
        for i, chunk in enumerate(model_chunks):
            if not hasattr(chunk, "strategy"):
                raise ValueError(f"FullyShardedOptimizer: model chunk {i} is not a FullyShardedDataParallel chunk; "
                                 "set parallel.data_parallel_sharding_strategy=optim_grads or optim_grads_params")
        self.model_chunks = list(model_chunks)
        params, specs = [], []
        for chunk in self.model_chunks:
            for name, param in chunk.module.named_parameters():
                if param.requires_grad:
                    params.append(param)
                    specs.append(chunk.specs[name])
        super().__init__(build_optimizer, params, specs, None, groups, scaler=scaler, clip_grad=clip_grad,
                         max_consecutive_skips=max_consecutive_skips, log_num_zeros=log_num_zeros)

    # --- hooks of OptimizerWrapper ---------------------------------------------------------
    def _build_entries(self, params: list, specs: list) -> list:
        entries = []
        for param, spec in zip(params, specs):
            local, lo, hi = local_shard(param)
            if local.dtype != torch.float32:
                raise ValueError(f"FullyShardedOptimizer: sharded param dtype {local.dtype}; FSDP's shards are the "
                                 "fp32 master weights (build the chunk in fp32, compute_dtype casts)")
            # aliases the shard: stepping `main` updates FSDP's sharded param in place
            entries.append(LocalShardEntry(param, spec, torch.nn.Parameter(local.view(-1)), lo, hi))
        return entries

    def _copy_model_grads_to_main_grads(self) -> None:
        for e in self.entries:
            grad = e.model_param.grad
            e.main.grad = None if grad is None else grad.to_local().reshape(-1).float()

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        """Nothing to copy while ``main`` aliases the shard; a shard FSDP re-allocated (its lazy init pads a shard
        whose storage changed) gets the values, and ``main`` follows it from then on."""
        for e in self.entries:
            local = e.model_param.to_local()
            if local.numel() and local.data_ptr() != e.main.data_ptr():
                local.view(-1).copy_(e.main)
                e.main.data = local.view(-1)

    def _grad_stats_groups(self) -> list:
        # the shards of one shard group are distinct elements: SUM / MAX over it (DP; HSDP's replicas hold the same
        # shards again: not summed), then over TP x PP
        return [self.groups.dp_shard_group, self.groups.mp_group]

    def _expert_stats_groups(self) -> list:
        # ep > 1: the experts' shards are distinct within expert-DP (their FSDP mesh), then over TP x PP and EP
        return [self.groups.edp_group, self.groups.mp_group] + self._ep_groups()

    # --- accounting ----------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """Bytes of the inner optimizer's state on this rank (the fp32 master weights are the params themselves)."""
        return sum(v.numel() * v.element_size() for state in self.optimizer.state.values()
                   for v in state.values() if isinstance(v, torch.Tensor))
