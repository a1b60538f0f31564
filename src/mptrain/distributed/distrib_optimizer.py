"""ZeRO-1 distributed optimizer: fp32 main params and optimizer state only for this DP rank's shard.

Megatron-LM ``megatron/core/optimizer/distrib_optimizer.py``, on top of
our `GradBuffer` layout (buckets padded to a multiple of dp, grad_buffer.py):

    bucket b, elements [start, end), n = end - start, dp ranks r = 0..dp-1
    rank r owns  [start + r·n/dp, start + (r+1)·n/dp)        ("shard")
    a param's piece on rank r = its slot ∩ the shard          (at most one contiguous piece per param)

One iteration:
1. DDP reduce-scatters each bucket (SUM): the shard now holds the DP-summed grad; finalize scales it.
2. `step`: main grads = the shard's buffer elements (fp32 view, or an fp32 copy of bf16/fp16
   grads) → unscale by 1/S and look for inf/nan → found_inf MAX-reduced over DP then MP (every
   rank of the world agrees) → grad norm over the pieces that count (`ShardSpec.counts_on`),
   SUM-reduced over DP then MP (each distinct element once: pieces tile each param across DP) →
   clip → inner optimizer step on the fp32 pieces → write the pieces into a bucket-sized scratch
   (param dtype values) → all-gather over DP → copy every param of the bucket from the scratch
   (`DistributedDataParallel.start_param_sync`; under ``parallel.overlap_param_gather`` the all-gather
   is left running and the copy waits for the bucket's first use in the next forward).
A skipped step (found_inf) changes nothing and gathers nothing.
3. Checkpoint: `OptimizerWrapper.sharded_state_dict` lists each piece with its ``flat_range`` (elements
   [lo, hi) of the flattened local param); `mptrain.checkpoint.reshard.flat_piece_chunks` maps it to
   global boxes, so the state loads under any DP size or ZeRO setting.

`wrapper_target` / `build_optimizer_wrapper` live here, above the wrappers they choose between: the
one rule that a built-in wrapper becomes `DistributedOptimizer` with ``parallel.use_distributed_optimizer``.

Memory: main params + Adam's exp_avg/exp_avg_sq are 12 bytes per owned element, i.e. ≈ 12·N/dp
bytes per rank instead of 12·N (`optimizer_state_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from mptrain.components import build, extra_keys, resolve
from mptrain.distributed.fsdp_optimizer import FullyShardedOptimizer
from mptrain.distributed.strategy import NO_SHARD, OPTIM
from mptrain.errors import ConfigError
from mptrain.precision.optimizer import BUILTIN_WRAPPERS, OPTIMIZER_WRAPPER, MainParamEntry, OptimizerWrapper

__all__ = ["DistributedOptimizer", "ShardEntry", "build_optimizer_wrapper", "wrapper_target"]


@dataclasses.dataclass
class ShardEntry(MainParamEntry):
    """This rank's contiguous piece of one model param: param elements [lo, hi) (flattened) =
    buffer elements [buf_lo, buf_lo + hi - lo) inside ``bucket`` of ``buffer``; ``main`` is fp32 [hi - lo]."""

    chunk: int
    name: str
    buffer: object
    bucket: object
    lo: int
    hi: int
    buf_lo: int

    @property
    def flat_range(self) -> Optional[tuple]:
        return (self.lo, self.hi)


class DistributedOptimizer(OptimizerWrapper):
    """ZeRO-1 over the DP group; `OptimizerWrapper`'s step / interface with sharded main params.

    Args:
        build_optimizer: ``param_groups -> torch.optim.Optimizer`` (`mptrain.optim.build_optimizer_factory`).
        model_chunks: this rank's `DistributedDataParallel` chunks built with ``use_distributed_optimizer=True``.
        groups: `ParallelGroups`.
        scaler, clip_grad, max_consecutive_skips, log_num_zeros: as `OptimizerWrapper`.
    Raises:
        ValueError: a chunk was not built for the distributed optimizer.
    """

    def __init__(
        self,
        build_optimizer: Callable,
        model_chunks: list,
        groups,
        *,
        scaler=None,
        clip_grad: float = 0.0,
        max_consecutive_skips: int = 0,
        log_num_zeros: bool = False,
    ) -> None:
        for i, chunk in enumerate(model_chunks):
            if not chunk.use_distributed_optimizer:
                raise ValueError(
                    f"DistributedOptimizer: model chunk {i} was wrapped with use_distributed_optimizer=False; "
                    "build DistributedDataParallel with parallel.use_distributed_optimizer=true"
                )
        self.model_chunks = list(model_chunks)  # needed by _build_entries, which the base __init__ calls
        params, specs = [], []
        for chunk in self.model_chunks:
            for name, param, _ in chunk.named_main_grads():
                params.append(param)
                specs.append(chunk.specs[name])
        super().__init__(
            build_optimizer,
            params,
            specs,
            None,
            groups,
            scaler=scaler,
            clip_grad=clip_grad,
            max_consecutive_skips=max_consecutive_skips,
            log_num_zeros=log_num_zeros,
        )

    # --- hooks of OptimizerWrapper ---------------------------------------------------------
    def _build_entries(self, params: list, specs: list) -> list:
        """One `ShardEntry` per param that intersects this rank's shard of its bucket (buffer order)."""
        entries = []
        for ci, chunk in enumerate(self.model_chunks):
            for buf in chunk.grad_buffers:
                _, rank, size = buf.reduction(self.groups)  # expert weights: sharded over expert-DP
                for bucket in buf.buckets:
                    s_lo, s_hi = bucket.shard_range(rank, size)
                    for param in buf.bucket_params(bucket):
                        slot = buf.slot(param)
                        b_lo, b_hi = max(slot.start, s_lo), min(slot.end, s_hi)
                        if b_lo >= b_hi:
                            continue
                        lo, hi = b_lo - slot.start, b_hi - slot.start
                        main = torch.nn.Parameter(param.detach().reshape(-1)[lo:hi].to(torch.float32).clone())
                        entries.append(
                            ShardEntry(param, chunk.specs[slot.name], main, ci, slot.name, buf, bucket, lo, hi, b_lo)
                        )
        return entries

    def _grad_stats_groups(self) -> list:
        # DP × CP shards differ: SUM over DP × CP (the pieces of one replica) then over MP (TP x PP).
        return [self.groups.dp_cp_group, self.groups.mp_group]

    def _expert_stats_groups(self) -> list:
        # expert weights are sharded over expert-DP, and each EP rank holds other experts: EDP x EP x MP tiles the grid
        return [self.groups.edp_group] + self._ep_groups() + [self.groups.mp_group]

    def _copy_model_grads_to_main_grads(self) -> None:
        for e in self.entries:
            view = e.buffer.data[e.buf_lo : e.buf_lo + e.hi - e.lo]
            # .float() aliases the fp32 buffer (unscale/clip then act in place, as Megatron) and copies fp16/bf16.
            e.main.grad = view.float()

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated pieces into per-bucket scratch and hand each bucket to its chunk's all-gather over DP
        (`DistributedDataParallel.start_param_sync`: into the model params now, or under
        ``parallel.overlap_param_gather`` where the next forward first uses them)."""
        by_bucket: dict = {}
        for e in self.entries:
            by_bucket.setdefault((id(e.buffer), e.bucket.index), []).append(e)
        for chunk in self.model_chunks:
            for buf in chunk.grad_buffers:
                # the forward reaches the last bucket first (buffer order is reverse registration order): its
                # all-gather goes first, so that under overlap_param_gather it is the first to arrive (Megatron)
                for bucket in reversed(buf.buckets):
                    # Scratch in the buffer's dtype: the param dtype, or fp32 (which holds any
                    # fp16/bf16 value exactly), so every param gets its own dtype's rounding.
                    scratch = torch.zeros(bucket.numel, dtype=buf.dtype, device=buf.data.device)
                    for e in by_bucket.get((id(buf), bucket.index), []):
                        at = e.buf_lo - bucket.start
                        scratch[at : at + e.hi - e.lo].copy_(e.main.detach().to(e.model_param.dtype))
                    chunk.start_param_sync(buf, bucket, scratch)

    # --- accounting ----------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """Bytes this rank holds for optimizer state: fp32 main params + every inner-state tensor."""
        total = sum(e.main.numel() * e.main.element_size() for e in self.entries)
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total


def wrapper_target(precision_cfg, use_distributed_optimizer: bool, *, sharding_strategy: Optional[str] = None):
    """The wrapper class that runs, the one rule: ``precision._target_``, except that with
    ``parallel.use_distributed_optimizer=true`` (strategy ``optim``) a built-in wrapper (FP32Optimizer /
    MixedPrecisionOptimizer) is replaced by `DistributedOptimizer` (ZeRO-1 shards fp32 main params of any params
    dtype), and under ``optim_grads`` / ``optim_grads_params`` by `FullyShardedOptimizer` (it steps FSDP's fp32
    shards); a user wrapper must then itself subclass the one it replaces.

    ``sharding_strategy`` (`mptrain.distributed.strategy.sharding_strategy`) overrides ``use_distributed_optimizer``.

    The keys a user added to the node with ``+`` are checked here, before anything is written: each must be a
    keyword of the target, and none may be one the trainer passes itself (``clip_grad`` comes from
    ``train.clip_grad``).

    Raises:
        ConfigError: the target does not import or lacks a method; an added key the target does not take (with
            the closest ``precision`` key or keyword, if any) or that the trainer passes; a user wrapper that
            cannot shard with use_distributed_optimizer=true.
    """
    extras = extra_keys(precision_cfg)
    passed = sorted(set(extras) & set(OPTIMIZER_WRAPPER.runtime_keywords))
    if passed:
        source = {"clip_grad": " (train.clip_grad)", "max_consecutive_skips": " (loss_scaler.max_consecutive_skips)"}
        raise ConfigError(f"precision.{passed[0]}: the trainer passes {passed[0]!r} to the optimizer wrapper itself"
                          f"{source.get(passed[0], '')}; remove the key")
    schema_keys = [f.name for f in dataclasses.fields(precision_cfg)] if dataclasses.is_dataclass(precision_cfg) else []
    target, _ = resolve("precision", {"_target_": precision_cfg._target_, **extras}, OPTIMIZER_WRAPPER,
                        schema_keys=schema_keys)
    strategy = sharding_strategy or (OPTIM if use_distributed_optimizer else NO_SHARD)
    if strategy == NO_SHARD:
        return target
    sharded = DistributedOptimizer if strategy == OPTIM else FullyShardedOptimizer
    if target in BUILTIN_WRAPPERS:
        return sharded
    if isinstance(target, type) and issubclass(target, sharded):
        return target
    if strategy == OPTIM:
        raise ConfigError(f"precision._target_={precision_cfg._target_} is not a DistributedOptimizer, but "
                          "parallel.use_distributed_optimizer=true shards the optimizer; subclass "
                          "mptrain.distributed.DistributedOptimizer or set parallel.use_distributed_optimizer=false")
    raise ConfigError(f"precision._target_={precision_cfg._target_} is not a FullyShardedOptimizer, but "
                      f"parallel.data_parallel_sharding_strategy={strategy} steps FSDP's shards; subclass "
                      "mptrain.distributed.fsdp_optimizer.FullyShardedOptimizer or pick another strategy")


def build_optimizer_wrapper(precision_cfg, *, use_distributed_optimizer: bool, build_optimizer, model_chunks: list,
                            groups, scaler, clip_grad: float, max_consecutive_skips: int,
                            sharding_strategy: Optional[str] = None):
    """The optimizer wrapper over this rank's DDP ``model_chunks`` (the one place it is built).

    The runtime offers ``build_optimizer`` (param groups -> inner optimizer), the flat ``params`` /
    ``specs`` / ``grad_fn`` (the DDP main grad of each param), ``model_chunks``, ``groups``, ``scaler``,
    ``clip_grad``, ``max_consecutive_skips``; a wrapper gets those its constructor takes (FP32Optimizer
    and MixedPrecisionOptimizer the flat lists, DistributedOptimizer and FullyShardedOptimizer the chunks);
    ``sharding_strategy``: as `wrapper_target`.
    """
    params, specs, owner = [], [], {}
    for chunk in model_chunks:
        for name, param in chunk.module.named_parameters():
            params.append(param)
            specs.append(chunk.specs[name])
            owner[param] = chunk
    target = wrapper_target(precision_cfg, use_distributed_optimizer, sharding_strategy=sharding_strategy)
    node = {"_target_": target, **extra_keys(precision_cfg)}
    offered = dict(build_optimizer=build_optimizer, params=params, specs=specs, grad_fn=lambda p: owner[p].main_grad(p),
                   model_chunks=list(model_chunks), groups=groups, scaler=scaler, clip_grad=clip_grad,
                   max_consecutive_skips=max_consecutive_skips)
    return build("precision", node, OPTIMIZER_WRAPPER, mapped=offered, partial=False)
