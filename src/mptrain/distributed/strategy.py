"""``parallel.data_parallel_sharding_strategy``: what data parallelism shards (Megatron-FSDP's key and values).

====================  ========================================================  ===============================
strategy              each DP rank holds                                        built by
====================  ========================================================  ===============================
no_shard              full params, full grads, full optimizer state (DDP)       `DistributedDataParallel`
optim       (ZeRO-1)  full params and grads, 1/dp of fp32 main params + state   `DistributedOptimizer`
optim_grads (ZeRO-2)  1/dp of params, grads, main params and state; a layer's   `FullyShardedDataParallel`
                      params stay gathered from its forward to its backward     (torch's FSDP2 ``fully_shard``)
optim_grads_params    1/dp of everything; a layer's params are gathered for     `FullyShardedDataParallel`
           (ZeRO-3)   its forward, freed, and gathered again for its backward
====================  ========================================================  ===============================

``parallel.use_distributed_optimizer=true`` stays the spelling of ``optim``: the strategy's default (null) resolves
to ``optim`` with it and to ``no_shard`` without it, and an explicit ``no_shard`` beside it is a contradiction.
With dp = 1 there is nothing to shard: the two FSDP strategies then run as ``no_shard`` (same math, no gathers),
unless ``optim.optimizer_cpu_offload`` asks for the fp32 shards in host memory (FSDP2 over one rank).

Context parallelism (``parallel.context_parallel_size`` = cp > 1): the cp ranks of a sequence hold the same weights
and their grads sum, as the dp ranks' do, so every strategy reduces (and the FSDP ones shard) over the dp × cp
ranks (`mptrain.groups`: ``dp_cp``; torchtitan's ``dp_shard_cp`` mesh dimension, Megatron-FSDP's DP-CP group): "dp"
below reads dp × cp. The CP ring keeps exchanging K/V over the cp group.

HSDP (``parallel.data_parallel_shard_size`` = S < dp): the FSDP strategies shard within groups of S consecutive DP
ranks and replicate across the dp / S groups (`mptrain.groups`: ``dp_shard`` / ``dp_replicate``); each rank holds
1/S of the sharded parts. The strategies that do not shard params or grads (no_shard, optim) refuse it.

The rules here are pure (config only) and run in `mptrain.training.validate.validate_config`, before any
collective: what the FSDP strategies do not compose with is refused there with one line.
"""

from __future__ import annotations

from typing import Optional

from mptrain.errors import ConfigError, check_choice
from mptrain.groups import check_shard_size

NO_SHARD, OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS = "no_shard", "optim", "optim_grads", "optim_grads_params"
STRATEGIES = (NO_SHARD, OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS)
FULLY_SHARDED = (OPTIM_GRADS, OPTIM_GRADS_PARAMS)
"""The strategies that shard grads and params: built on FSDP2 (`mptrain.distributed.fsdp`)."""
KEY = "parallel.data_parallel_sharding_strategy"
SHARD_KEY = "parallel.data_parallel_shard_size"
OFFLOAD_KEY = "optim.optimizer_cpu_offload"


def sharding_strategy(parallel, data_parallel_size: Optional[int] = None, *, cpu_offload: bool = False) -> str:
    """The strategy that runs: ``parallel.data_parallel_sharding_strategy`` with null resolved through
    ``use_distributed_optimizer``; with ``data_parallel_size`` (the ranks that shard: dp × cp) 1 the FSDP
    strategies resolve to ``no_shard``, unless ``cpu_offload`` (``optim.optimizer_cpu_offload``: FSDP2 keeps the one
    rank's fp32 params in host memory).

    Raises:
        ConfigError: an unknown strategy; ``no_shard`` with ``use_distributed_optimizer=true``.
    """
    check_sharding_key(parallel)
    value = getattr(parallel, "data_parallel_sharding_strategy", None)
    if value is None:
        value = OPTIM if parallel.use_distributed_optimizer else NO_SHARD
    if value in FULLY_SHARDED and data_parallel_size == 1 and not cpu_offload:
        return NO_SHARD  # nothing to shard: the DDP path, without FSDP's copies
    return value


def running_strategy(cfg, data_parallel_size: int) -> str:
    """`sharding_strategy` of a whole config at ``data_parallel_size`` (dp × cp: `ParallelGroups.dp_cp_size`):
    ``optim.optimizer_cpu_offload`` keeps FSDP at dp × cp = 1."""
    return sharding_strategy(cfg.parallel, data_parallel_size,
                             cpu_offload=bool(getattr(cfg.optim, "optimizer_cpu_offload", False)))


def check_sharding_key(parallel) -> None:
    """The strategy is one of `STRATEGIES` (or null) and does not contradict ``use_distributed_optimizer``. Pure.

    Raises:
        ConfigError: one line naming the key(s) and the fix.
    """
    value = getattr(parallel, "data_parallel_sharding_strategy", None)
    if value is None:
        return
    check_choice(KEY, value, (None,) + STRATEGIES)
    if value == NO_SHARD and parallel.use_distributed_optimizer:
        raise ConfigError(f"{KEY}=no_shard contradicts parallel.use_distributed_optimizer=true (which shards the "
                          f"optimizer: {KEY}=optim); drop one of the two keys")


def check_hsdp(parallel, data_parallel_size: int) -> int:
    """``parallel.data_parallel_shard_size`` against the data-parallel size (dp × cp) and the strategy; returns the
    shard group size S (the whole DP group when null). Pure.

    Raises:
        ConfigError: S does not divide dp × cp (`mptrain.groups.check_shard_size`); S < dp × cp with a strategy
            that shards neither grads nor params (no_shard, optim).
    """
    shard = check_shard_size(getattr(parallel, "data_parallel_shard_size", None), data_parallel_size)
    strategy = sharding_strategy(parallel)
    if shard < data_parallel_size and strategy not in FULLY_SHARDED:
        raise ConfigError(f"{SHARD_KEY}={shard} (HSDP over data-parallel size {data_parallel_size}) needs {KEY}="
                          f"optim_grads or optim_grads_params, not {strategy}; set one of those or "
                          f"{SHARD_KEY}=null")
    return shard


def check_fully_sharded(cfg) -> None:
    """What ZeRO-2 / ZeRO-3 (`FULLY_SHARDED`) do not compose with, refused before any collective. Pure.

    Refused: HSDP of an MoE model (the experts shard over the expert-data-parallel group),
    ``parallel.overlap_param_gather`` (ZeRO-1's all-gather after the step; FSDP gathers each layer before its
    forward) and ``parallel.tp_comm_overlap``. Context parallelism composes: the FSDP mesh is the dp × cp group
    (`mptrain.distributed.fsdp.dp_mesh`). ``precision=fp8`` composes: each FP8 GEMM casts the weight FSDP gathered
    (`mptrain.layers.fp8.apply_fp8`'s ``cache_weight_casts``).

    Raises:
        ConfigError: one line naming the key that does not compose and the fix.
    """
    par = cfg.parallel
    strategy = getattr(par, "data_parallel_sharding_strategy", None)
    if getattr(cfg.optim, "optimizer_cpu_offload", False) and strategy not in FULLY_SHARDED:
        raise ConfigError(f"{OFFLOAD_KEY}=true offloads FSDP2's sharded fp32 params and optimizer state; it needs "
                          f"{KEY}=optim_grads_params (or optim_grads), not {sharding_strategy(par)}")
    if strategy not in FULLY_SHARDED:
        return
    fix = f"or set {KEY}=optim (ZeRO-1)"
    shard = getattr(par, "data_parallel_shard_size", None)
    if getattr(cfg.model, "num_moe_experts", None) and shard is not None:
        raise ConfigError(f"{SHARD_KEY}={shard} (HSDP) does not split the expert-data-parallel group of an MoE "
                          f"model (model.num_moe_experts={cfg.model.num_moe_experts}) yet; set {SHARD_KEY}=null")
    if par.overlap_param_gather:
        raise ConfigError(f"parallel.overlap_param_gather=true overlaps ZeRO-1's param all-gather; {KEY}={strategy} "
                          "gathers each layer before its forward itself: set parallel.overlap_param_gather=false")
    if par.tp_comm_overlap:
        raise ConfigError(f"parallel.tp_comm_overlap=true does not compose with {KEY}={strategy} yet; set "
                          f"parallel.tp_comm_overlap=false {fix}")
