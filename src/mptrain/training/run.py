"""`run(cfg)`: the pretrain flow of the design document, as one importable function.

validate (config + world size, checkpoint paths; the run folder planned) → init (distributed, groups)
→ build (model chunks per stage → Float16Module / DDP wrappers → optimizer + LR scheduler → data
provider → `Trainer`; loop hooks only when a fault-injection key is set: `mptrain.training.faults`) →
the run folder claimed (DESIGN.md §2: nothing is written before) → train
(`mptrain.training.loop.train`: checkpoint load, validation at iteration 0, the loop, final
evaluation, layout.json) → teardown in `finally`.

Every user error (`ConfigError`) is raised on every rank before the first collective.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
import traceback
from typing import Any, NoReturn

import numpy as np
import torch

from mptrain.config.batch_size import BatchSizeSchedule
from mptrain.config.schema import Config
from mptrain.checkpoint.args import apply_checkpoint_args
from mptrain.config.schema import as_config
from mptrain.config.train import train_iters_of
from mptrain.data.provider import build_provider, provider_target
from mptrain.data.tokenizers import build_tokenizer, check_vocab_size
from mptrain.training.validate import validate_config
from mptrain.distributed.ddp import DistributedDataParallel
from mptrain.distributed.finalize import finalize_model_grads
from mptrain.distributed.fsdp import FullyShardedDataParallel
from mptrain.distributed.strategy import FULLY_SHARDED, OPTIM, running_strategy
from mptrain.errors import ConfigError, StorageError, launch_rank_and_world, report_and_exit
from mptrain.groups import (TORCHRUN_WORLD_SIZE_FLAG, ParallelGroups, build_groups, init_distributed,
                            read_dist_env)
from mptrain.layers.fp8 import apply_fp8, check_fp8_environment, fp8_recipe_from
from mptrain.layers.gpt import build_model_chunks
from mptrain.layers.mappings import enable_tp_comm_overlap
from mptrain.layers.moe import RoutingStats
from mptrain.layers.sharding import collect_shard_specs
from mptrain.optim.builders import build_optimizer_factory
from mptrain.optim.lr_scheduler import build_lr_scheduler
from mptrain.precision import params_dtype as precision_params_dtype
from mptrain.precision.module import Float16Module, unwrap
from mptrain.distributed.distrib_optimizer import build_optimizer_wrapper
from mptrain.precision.optimizer import TooManySkippedStepsError
from mptrain.precision.scaler import build_loss_scaler
from mptrain.schedules import ScheduleSpec, ScheduleStats, build_schedule
from mptrain.training.batch import CheckedProvider, uses_document_offsets
from mptrain.training.faults import install_fault_hooks
from mptrain.training.host_malloc import tune_cpu_malloc
from mptrain.training.loop import train
from mptrain.training.recorder import Recorder, finished_summary
from mptrain.runs.folder import checkpoint_save_refusal, path_inside, planned_config
from mptrain.runs.sweep import current_sweep_job
from mptrain.training.timers import Timers
from mptrain.training.interrupt import Interrupted, exit_interrupted
from mptrain.training.step import Trainer, make_forward_step
from mptrain.training.watchdog import StepWatchdog, StopSignal


@dataclasses.dataclass
class Built:
    """The runtime objects of one job (what checkpointing and the loop share)."""

    cfg: Config
    groups: ParallelGroups
    trainer: Trainer
    provider: CheckedProvider
    chunks: list
    rng_tracker: Any
    scaler: Any
    hooks: list = dataclasses.field(default_factory=list)  # loop hooks (`mptrain.training.faults`); none by default
    faults: Any = None  # the checkpoint write's fault site (`mptrain.training.faults.FaultInjector`), or None
    fp8: Any = None  # what precision=fp8 converted on this rank (`mptrain.layers.fp8.Fp8Summary`), or None


def seed_host_rngs(seed: int, groups: ParallelGroups) -> None:
    """Seed Python's `random` and NumPy's global RNG as Megatron's ``_set_random_seed`` does
    (``seed + 100 * pp_rank``; torch is seeded with the same number by `init_rng_tracker`), so a
    user component drawing from them is reproducible. A resume then restores or re-derives them
    from the checkpoint (`mptrain.checkpoint.rng`)."""
    host_seed = (seed + 100 * groups.pp_rank) % 2**32
    random.seed(host_seed)
    np.random.seed(host_seed)


def build_model_and_optimizer(cfg: Config, groups: ParallelGroups, derived, *, vocab_size: int):
    """Model chunks wrapped as DDP(Float16Module(GPTModel)), or under ZeRO-2 / ZeRO-3
    (``parallel.data_parallel_sharding_strategy``) as FullyShardedDataParallel(GPTModel), the optimizer wrapper and
    the LR scheduler.

    Components (`mptrain.components`): the loss scaler (``loss_scaler._target_``), the inner optimizer
    (``optim._target_``), the wrapper (``precision._target_``, `wrapper_target`'s rule for ZeRO-1) and
    the LR schedule (``optim.lr_scheduler._target_``), each built in its one place.
    """
    seed_host_rngs(cfg.train.seed, groups)
    params_dtype = precision_params_dtype(cfg.precision.name)
    if cfg.parallel.tp_comm_overlap:
        enable_tp_comm_overlap(groups.tp_group)
    raw_chunks = build_model_chunks(
        cfg.model, cfg.parallel, groups, vocab_size=vocab_size, seed=cfg.train.seed, params_dtype=torch.float32,
        device=groups.device,
    )
    rng_tracker = raw_chunks[0].rng_tracker
    strategy = running_strategy(cfg, groups.dp_cp_size)  # the cp ranks shard too
    chunks = []
    for chunk in raw_chunks:
        specs = collect_shard_specs(chunk)
        if strategy in FULLY_SHARDED:  # ZeRO-2 / ZeRO-3: FSDP2 casts the gathered fp32 params itself
            chunks.append(FullyShardedDataParallel(chunk, groups, strategy=strategy, compute_dtype=params_dtype,
                                                   specs=specs, is_last_stage=chunk.post_process,
                                                   cpu_offload=cfg.optim.optimizer_cpu_offload))
            continue
        module = chunk
        if params_dtype != torch.float32:
            module = Float16Module(chunk, params_dtype, is_first_stage=chunk.pre_process, is_last_stage=chunk.post_process)
            specs = {f"module.{k}": v for k, v in specs.items()}
        chunks.append(
            DistributedDataParallel(
                module,
                groups,
                specs=specs,
                grad_reduce_in_fp32=cfg.parallel.grad_reduce_in_fp32 or params_dtype != torch.float32,
                overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                bucket_size=cfg.parallel.bucket_size,
                use_distributed_optimizer=strategy == OPTIM,
                gradient_accumulation_fusion=cfg.parallel.gradient_accumulation_fusion,
                overlap_param_gather=cfg.parallel.overlap_param_gather,
            )
        )
    scaler = build_loss_scaler(cfg.loss_scaler, cfg.precision.name)
    optimizer = build_optimizer_wrapper(
        cfg.precision, use_distributed_optimizer=strategy == OPTIM, sharding_strategy=strategy,
        build_optimizer=build_optimizer_factory(cfg.optim), model_chunks=chunks, groups=groups, scaler=scaler,
        clip_grad=cfg.train.clip_grad, max_consecutive_skips=cfg.loss_scaler.max_consecutive_skips)
    lr_scheduler = build_lr_scheduler(cfg.optim, optimizer, train_iters=cfg.train.train_iters,
                                      train_samples=cfg.train.train_samples,
                                      global_batch_size=cfg.train.global_batch_size,
                                      rampup_batch_size=cfg.train.rampup_batch_size,
                                      step_batch_size_schedule=cfg.train.step_batch_size_schedule)
    return chunks, optimizer, lr_scheduler, rng_tracker, scaler


def convert_to_fp8(cfg: Config, chunks: list):
    """precision=fp8: the block linears' GEMMs in FP8 (`apply_fp8` on the unwrapped chunks; a compute mode:
    parameters and checkpoints unchanged); returns its `Fp8Summary`, None for other precisions.

    The tensorwise weight casts are made once per iteration, except on chunks FSDP2 shards (ZeRO-2 / ZeRO-3):
    there a weight is whole only inside its layer's forward and backward, where each GEMM casts the gathered one.
    """
    fsdp = any(isinstance(c, FullyShardedDataParallel) for c in chunks)
    return apply_fp8([unwrap(c) for c in chunks], fp8_recipe_from(cfg.precision), num_layers=cfg.model.num_layers,
                     cache_weight_casts=not fsdp)


def build(cfg: Config, groups: ParallelGroups, derived, tokenizer, vocab_size: int) -> Built:
    """Everything a job needs, built collectively on every rank."""
    chunks, optimizer, lr_scheduler, rng_tracker, scaler = build_model_and_optimizer(cfg, groups, derived, vocab_size=vocab_size)
    fp8 = convert_to_fp8(cfg, chunks)
    with_mask = bool(cfg.data.reset_attention_mask)
    # document boundaries as offsets (no [b, 1, s, s] mask) unless the dense mask is asked for (or CP needs it)
    offsets = uses_document_offsets(cfg)
    needs = groups.tp_rank == 0 and (groups.is_first_stage or groups.is_last_stage or with_mask)
    provider = build_provider(  # data._target_ (collective: every rank builds it here)
        cfg.data,
        tokenizer=tokenizer,
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        needs_data=needs,
    )
    # the reading rank checks every batch against the config before the TP broadcast (training/batch.py)
    provider = CheckedProvider(provider, source=provider_target(cfg.data), micro_batch_size=cfg.train.micro_batch_size,
                               seq_length=cfg.model.seq_length, vocab_size=vocab_size, with_attention_mask=with_mask,
                               device=groups.device, document_offsets=offsets)
    timers = Timers(cfg.train.timing_log_level, groups.device)
    schedule_spec = ScheduleSpec(groups=groups, num_microbatches=derived.num_microbatches,
                                 seq_length=cfg.model.seq_length, micro_batch_size=cfg.train.micro_batch_size,
                                 hidden_size=cfg.model.hidden_size, dtype=precision_params_dtype(cfg.precision.name),
                                 sequence_parallel=derived.sequence_parallel,
                                 max_tokens=cfg.train.global_batch_size * cfg.model.seq_length)
    trainer = Trainer(
        groups=groups,
        chunks=chunks,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        forward_backward_func=build_schedule(cfg.schedule, schedule_spec),
        schedule_spec=schedule_spec,
        forward_step=make_forward_step(
            groups,
            micro_batch_size=cfg.train.micro_batch_size,
            seq_length=cfg.model.seq_length,
            with_attention_mask=with_mask,
            device=groups.device,
            timers=timers,
            document_offsets=offsets,
        ),
        finalize_model_grads=finalize_model_grads,
        device=groups.device,
        stats=ScheduleStats(timers=timers),
        timers=timers,
        # each iteration's global batch (train.rampup_batch_size, train.step_batch_size_schedule)
        batch_sizes=BatchSizeSchedule.of(cfg.train, seq_length=cfg.model.seq_length),
        # null: deferred where the device runs ahead of the host (CUDA); the CPU's work is synchronous
        defer_step_read=(groups.device.type == "cuda" if cfg.train.defer_step_read is None
                         else bool(cfg.train.defer_step_read)),
        fp8_weight_casts=fp8.weight_casts if fp8 is not None else None,
        routing_stats=RoutingStats.for_model(cfg.model),
    )
    built = Built(cfg=cfg, groups=groups, trainer=trainer, provider=provider, chunks=chunks, rng_tracker=rng_tracker,
                  scaler=scaler, fp8=fp8)
    built.hooks = install_fault_hooks(built, attempt=read_dist_env().restart_count)  # [] unless debug faults are set
    return built


def run(cfg: Any) -> dict:
    """Train one job described by `cfg` (a Hydra DictConfig or a `Config`): validate, init, build, train;
    returns the job's summary.

    Raises:
        ConfigError: invalid config (on every rank, before any collective).
    """
    t_start = time.time()
    env = read_dist_env()
    cfg, derived, plan = _validated(cfg, env.world_size)
    if plan.finished(cfg.train.train_iters):
        # the finished run relaunched: Megatron loads it and exits as done; here nothing needs loading (the
        # plan read the checkpoint's iteration): one line, exit 0, nothing written
        if env.rank == 0:
            print(plan.relaunch.finished_line(cfg.train.train_iters), flush=True)
        return finished_summary(plan.dir, derived)
    tokenizer = build_tokenizer(cfg.data)
    try:
        vocab_size = check_vocab_size(cfg.model.vocab_size, tokenizer.vocab_size,
                                      from_checkpoint=bool(cfg.checkpoint.use_checkpoint_args))
    except ConfigError as err:
        err.symmetric = True  # the config and the tokenizer's file: every rank raises it, rank 0 prints it
        raise
    groups = _init(cfg, env, derived)
    recorder = None
    stop = StopSignal()  # SIGTERM / SIGINT: the loop ends at its checkpointer's `stop_reason`
    # the rank heartbeat (training/watchdog.py): armed around each step from this process's second on
    heartbeat = StepWatchdog(cfg.train.step_timeout_s, rank=groups.rank) if cfg.train.step_timeout_s is not None else None
    clean_exit = False
    built = None
    try:
        built = build(cfg, groups, derived, tokenizer, vocab_size)  # data, optimizer: their errors come first
        recorder = Recorder.open(cfg, groups, derived, plan=plan, vocab_size=vocab_size, t_start=t_start)
        result = train(built, recorder, stop=stop, heartbeat=heartbeat)
        clean_exit = True
        return result
    except (ConfigError, StorageError, TooManySkippedStepsError, Interrupted) as err:
        # raised alike on every rank (validation, data, checkpoint shape, a failed save, skips, Ctrl-C
        # after the loop's last save): no peer waits; a StorageError of rank 0's metrics writes is this
        # rank's alone (all_ranks False)
        clean_exit = getattr(err, "all_ranks", True)
        raise
    finally:
        stop.uninstall()
        if recorder is not None:
            recorder.close()
        for chunk in built.chunks if built is not None else ():  # each a ChunkWrapper (build_model_and_optimizer)
            chunk.release()  # the grad hooks' cycles through C++ (ChunkWrapper.release): the model can be freed
        # After a failure on this rank the communicators are left alone (destroying an NCCL group
        # while a peer waits in a collective hangs): the process exits and torchrun stops the others.
        if clean_exit:
            groups.destroy()
        if heartbeat is not None:
            heartbeat.stop()  # last: after a failure mid-step it stays armed through this cleanup


def _validated(cfg: Any, world_size: int) -> tuple:
    """(`Config`, `DerivedLayout`, `RunDirPlan`) of a valid config, checked before any collective; the run
    folder is planned (`mptrain.runs.folder.planned_config`: `${run.dir}` resolves to it), not created.

    Raises:
        ConfigError: marked ``symmetric`` when it depends on the config and the world size only.
    """
    try:
        # the model of checkpoint.load, when it carries one (the default folder then names that model)
        cfg, plan = planned_config(cfg, sweep_job=current_sweep_job(),
                                   resolve=lambda composed: apply_checkpoint_args(as_config(composed)))
        # the launcher's own flag in the fix of a world size the layout does not divide (`make train` sets
        # MPTRAIN_WORLD_SIZE_FLAG=NPROC: its users set the world size with NPROC=, not torchrun's flag)
        derived = validate_config(cfg, world_size,
                                  world_size_flag=os.environ.get("MPTRAIN_WORLD_SIZE_FLAG", TORCHRUN_WORLD_SIZE_FLAG))
        # train.train_samples: Megatron's update_train_iters
        cfg.train.train_iters = train_iters_of(cfg.train, seq_length=cfg.model.seq_length)
    except ConfigError as err:
        if not hasattr(err, "symmetric"):  # config + world size only: every rank raises the same line
            err.symmetric = True  # (rank 0 prints it); an environment-dependent one says symmetric=False
        raise
    try:
        check_fp8_environment(cfg.precision)  # torchao, the GPU's FP8 tensor cores: this machine, no collective
        _check_checkpoint_paths(cfg)
    except ConfigError as err:
        err.per_node = True  # this machine's: alike on its ranks, maybe not on another node's (`exit_on_config_error`)
        raise
    return cfg, derived, plan


def _init(cfg: Config, env, derived) -> ParallelGroups:
    """Process-wide settings, the default process group and this rank's `ParallelGroups`."""
    if cfg.precision.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device = init_distributed(env, timeout_s=cfg.train.timeout_s)
    if device.type == "cpu" and cfg.run.cpu_malloc_tuning:
        tune_cpu_malloc()  # no page faults re-growing the heap every step (training/host_malloc.py)
    return build_groups(
        derived.tensor_model_parallel_size,
        derived.pipeline_model_parallel_size,
        derived.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=derived.expert_model_parallel_size,
        expert_tensor_parallel_size=derived.expert_tensor_parallel_size,
        context_parallel_size=derived.context_parallel_size,
        data_parallel_shard_size=cfg.parallel.data_parallel_shard_size,
        device=device,
    )


def _check_checkpoint_paths(cfg: Config) -> None:
    """Checkpoint folders that cannot work, rejected before any collective (not at the first save).

    Raises:
        ConfigError: `checkpoint.save` is a file, lies under one or is not writable (`save_refusal`);
            `checkpoint.load` does not exist or holds no
            checkpoint and is not also the save folder (resuming into the folder a job saves to is the usual
            restart pattern, and starts fresh on the first attempt), is one iteration's folder or a file, or
            `checkpoint.load_iteration` is not complete there (`load_refusal`);
            `checkpoint.save` already holds checkpoints and `checkpoint.load` is not that folder
            (`checkpoint_save_refusal`).
    """
    from pathlib import Path

    from mptrain.checkpoint.atomic import load_refusal, save_refusal

    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    # a save folder inside run.dir is the run folder's to judge (`mptrain.runs.folder.planned_config`)
    in_run_dir = bool(cfg.run.dir) and path_inside(save, Path(cfg.run.dir))
    refusal = save_refusal(save) if save and not in_run_dir else None
    if refusal is not None:
        raise ConfigError(refusal)
    refusal = load_refusal(load, cfg.checkpoint.load_iteration, save) if load else None
    if refusal is not None:
        raise ConfigError(refusal)
    refusal = None if in_run_dir else checkpoint_save_refusal(save, load)
    if refusal is not None:
        raise ConfigError(refusal)


def exit_on_config_error(err: BaseException) -> NoReturn:
    """Print ``err`` as one ``error: ...`` line and exit 1 (never returns; `report_and_exit`).

    A start-up config error (`validate_config`: config + world size only; ``err.symmetric``) and the
    skip limit (decided by an all-reduce) are the same on every rank: rank 0 alone prints it, so a
    torchrun job shows one line, not one per rank. This machine's (``err.per_node``: torchao, the GPU,
    the checkpoint folders) are alike on a node's ranks: each node's local rank 0 prints it. Other
    errors may differ between ranks (an unset ``${oc.env:...}``): every failing rank prints its own at
    once and exits after `mptrain.errors.CONFIG_ERROR_GRACE_S`.
    """
    try:
        env = read_dist_env()
        rank, world_size, local_rank = env.rank, env.world_size, env.local_rank
    except ConfigError:  # the launch environment is itself the error (a SLURM node list nothing can parse)
        rank, world_size = launch_rank_and_world()
        local_rank = rank
    symmetric = getattr(err, "symmetric", False) or isinstance(err, TooManySkippedStepsError)
    if getattr(err, "per_node", False):  # this machine's (a file, torchao, the GPU): each node's first rank prints
        rank, symmetric = local_rank, True
    report_and_exit(f"error: {err}", rank=rank, world_size=world_size, symmetric=symmetric)


def _release_default_group() -> None:
    """A clean end releases the default group too (`ParallelGroups.destroy` keeps it for the test pool
    and a sweep's next job); left to interpreter exit, gloo's threads can abort the process."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def hydra_main(cfg) -> Any:
    """The task function of train.py.

    Single run: a `ConfigError` prints one line to stderr and exits 1 (no traceback); any other
    failure prints the traceback with the rank and exits 1 at once, without a collective teardown
    (torchrun then stops the other ranks; a hang is never the answer). In a multirun the
    exception propagates to the sweep callback, which records it (`mptrain.runs.sweep`).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun:
        try:
            return run(cfg)  # the sweep callback records and applies the policy
        except Interrupted as err:  # Ctrl-C ends the sweep: one line, exit 130
            exit_interrupted(err.stop)
    try:
        result = run(cfg)
        _release_default_group()
        return result
    except (ConfigError, StorageError, TooManySkippedStepsError) as err:  # one line, exit 1
        exit_on_config_error(err)
    except Interrupted as err:  # Ctrl-C: the loop finished its step and saved it; one line, exit 130
        _release_default_group()
        exit_interrupted(err.stop)
    except KeyboardInterrupt:  # Ctrl-C before the loop's stop handler took over SIGINT: one line, exit 130
        exit_interrupted(None)
    except BaseException as err:  # noqa: BLE001
        if isinstance(err, SystemExit) and not err.code:
            raise
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"[rank {rank}] job failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
