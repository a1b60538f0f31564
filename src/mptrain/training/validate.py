"""Every DESIGN.md §5 config check, as one pure function run on every rank before any collective.

`validate_config(cfg, world_size)` reads only the config and the world size (no torch.distributed,
no files, no environment), so every rank reaches the same verdict and raises the same one-line
`ConfigError` before the first collective: no rank is left waiting in a collective that the others
never join. It returns the facts derived from the layout (`DerivedLayout`).

Decisions recorded here (beyond DESIGN.md):
- Schedule-vs-layout rules live with each schedule (`mptrain.schedules.resolve_schedule`, the
  schedule's ``check_layout``): gpipe / 1f1b with pp = 1 degenerate to no_pipelining, vpp needs the
  interleaved schedule (which needs num_microbatches % pp == 0), no_pipelining needs pp = 1.
- `sequence_parallel=true` with tp = 1 is allowed and does nothing (`DerivedLayout.sequence_parallel`
  is False); with tp > 1 it needs seq_length % tp == 0 (activations are split along s).
- A loss scaler with fp32 / bf16 is allowed (it only multiplies the loss); fp16 without one is an error.
- Vocabulary checks need the tokenizer, so they are left to the caller:
  `mptrain.data.tokenizers.check_vocab_size`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from mptrain.checkpoint.finetune import check_load_keys
from mptrain.config.batch_size import (check_batch_layout, check_rampup_batch_size, check_step_batch_size_schedule,
                                       varying_batch_key)
from mptrain.config.schema import Config, as_config
from mptrain.config.train import train_iters_of
from mptrain.data.provider import check_data_config
from mptrain.distributed.distrib_optimizer import wrapper_target
from mptrain.distributed.param_gather import check_overlap_param_gather
from mptrain.distributed.strategy import check_fully_sharded, check_hsdp, sharding_strategy
from mptrain.errors import ConfigError
from mptrain.groups import TORCHRUN_WORLD_SIZE_FLAG, check_num_experts, expert_layout, validate_layout
from mptrain.layers.compile import resolve_compile_layers
from mptrain.layers.context_parallel import check_context_parallel
from mptrain.layers.fp8 import check_fp8_config
from mptrain.layers.gpt import check_model_components, check_model_config
from mptrain.optim.builders import check_optimizer
from mptrain.optim.lr_scheduler import check_lr_scheduler
from mptrain.precision import params_dtype
from mptrain.precision.scaler import build_loss_scaler, scaler_label
from mptrain.precision.optimizer import check_max_consecutive_skips
from mptrain.schedules import PipelineLayout, resolve_schedule
from mptrain.training.loggers import check_logger_config
from mptrain.training.faults import check_fault_config
from mptrain.training.profiler import check_profile_config

MAX_TIMEOUT_S = 1e9  # train.timeout_s / step_timeout_s (~31 years): torch and gloo overflow far above

@dataclasses.dataclass(frozen=True)
class DerivedLayout:
    """What the config and the world size imply (computed once, identical on every rank).

    Attributes:
        world_size: processes in the job.
        tensor_model_parallel_size, pipeline_model_parallel_size: as configured.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank; None when 1 / unset.
        data_parallel_size: world_size / (tp × cp × pp).
        expert_model_parallel_size, expert_tensor_parallel_size, expert_data_parallel_size: the expert grid
            (ep as configured; etp with null resolved to tp; edp = world_size / (etp × ep × pp)).
        num_microbatches: global_batch_size / (micro_batch_size × dp), micro-batches per DP rank
            per iteration at train.global_batch_size (with train.rampup_batch_size or
            train.step_batch_size_schedule each iteration runs its own, `mptrain.config.batch_size.BatchSizeSchedule`).
        schedule: the schedule that runs: no_pipelining | gpipe | 1f1b | interleaved_1f1b (`auto` and
            the pp = 1 degenerations resolved), or a user schedule's dotted path (`mptrain.schedules.schedule_name`).
        sequence_parallel: True only when asked for and tp > 1.
        loss_scaler: the scaler that runs: none | dynamic | constant (`auto` resolved).
    """

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    data_parallel_size: int
    num_microbatches: int
    schedule: str
    sequence_parallel: bool
    loss_scaler: str
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    expert_data_parallel_size: int = 1
    context_parallel_size: int = 1


def _positive(key: str, value: Optional[int], *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be an integer >= 1{' or null' if allow_none else ''}")


def check_parallel_sizes(cfg: Config, world_size: int, *,
                         world_size_flag: str = TORCHRUN_WORLD_SIZE_FLAG) -> tuple[int, int, Optional[int], int]:
    """World size vs tp × pp and vs the expert grid, the virtual pipeline size, the expert count vs ep;
    returns (tp, pp, vpp or None, dp).

    Raises:
        ConfigError: sizes below 1 (naming the key); world size not divisible by tp × pp (the
            DESIGN.md §5 line) or by etp × ep × pp, or vpp > 1 with pp = 1 (`mptrain.groups.validate_layout`);
            model.num_moe_experts vs expert_model_parallel_size (`mptrain.groups.check_num_experts`).
    """
    par = cfg.parallel
    tp, pp, vpp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    _positive("parallel.tensor_model_parallel_size", tp)
    _positive("parallel.pipeline_model_parallel_size", pp)
    _positive("parallel.virtual_pipeline_model_parallel_size", vpp, allow_none=True)
    _positive("parallel.expert_model_parallel_size", par.expert_model_parallel_size)
    _positive("parallel.expert_tensor_parallel_size", par.expert_tensor_parallel_size, allow_none=True)
    # context parallelism's own rules (size, comm type, seq_length vs 2·cp, what it cannot run with)
    check_context_parallel(par, cfg.model, cfg.data)
    # world size vs tp × pp, tp × cp × pp and etp × ep × pp, vpp vs pp: the rules live in groups.py
    dp = validate_layout(world_size, tp, pp, vpp, expert_model_parallel_size=par.expert_model_parallel_size,
                         expert_tensor_parallel_size=par.expert_tensor_parallel_size,
                         context_parallel_size=par.context_parallel_size, world_size_flag=world_size_flag)
    check_hsdp(par, dp * par.context_parallel_size)  # HSDP's shard groups tile dp × cp
    # model.num_moe_experts: the MoE model's key (null or absent: a dense model)
    check_num_experts(getattr(cfg.model, "num_moe_experts", None), par.expert_model_parallel_size)
    return tp, pp, (vpp if vpp is not None and vpp > 1 else None), dp


def check_batch(cfg: Config, dp: int) -> int:
    """global_batch_size vs micro_batch_size × dp; returns num_microbatches.

    Raises:
        ConfigError: sizes below 1 or global_batch_size not divisible by micro_batch_size × dp.
    """
    t = cfg.train
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.global_batch_size", t.global_batch_size)
    step = t.micro_batch_size * dp
    if t.global_batch_size % step != 0:
        lower = max(step, t.global_batch_size // step * step)
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size × data-parallel "
            f"size = {t.micro_batch_size} × {dp} = {step}; set train.global_batch_size={lower} or {lower + step}, "
            f"or change train.micro_batch_size"
        )
    return t.global_batch_size // step


def check_schedule_at_each_batch(cfg: Config, tp: int, pp: int, vpp: Optional[int], dp: int, *,
                                 num_microbatches: int) -> str:
    """The schedule that runs (`resolve_schedule`: its layout rules) at the full global batch, and at every batch
    ``train.rampup_batch_size`` or ``train.step_batch_size_schedule`` reaches (each a multiple of
    micro_batch_size × dp: `check_batch_layout`); returns its name.

    Raises:
        ConfigError: the batches' divisibility; a schedule rule a reached batch breaks (interleaved 1F1B's
            num_microbatches % pp), naming the key and the iterations.
    """
    b = cfg.train.micro_batch_size

    def resolved(m: int) -> str:
        return resolve_schedule(cfg.schedule, PipelineLayout(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
            data_parallel_size=dp, num_microbatches=m, micro_batch_size=b)).name

    name = resolved(num_microbatches)
    key = varying_batch_key(cfg.train)
    for run in check_batch_layout(cfg.train, b, dp, seq_length=cfg.model.seq_length):
        try:
            run_name = resolved(run.global_batch_size // (b * dp))
        except ConfigError as err:
            raise ConfigError(f"{key} at {run.span}: {err}") from None
        if run_name != name:  # a user schedule whose check_layout picks by the micro-batch count
            raise ConfigError(f"schedule: {name} runs at train.global_batch_size but {run_name} at the "
                              f"{run.global_batch_size} of {run.span}; one schedule must run the whole job ({key})")
    return name


def resolve_loss_scaler(cfg: Config) -> str:
    """Start-up check of the precision / optimizer components (their rules live in their modules):
    precision name, loss scaler (built once: the fp16 rule), optimizer (a throwaway instance), LR
    schedule (a throwaway instance on it), wrapper class and the param all-gather's overlap. Returns the
    scaling that runs (none | dynamic | constant).

    Raises:
        ConfigError: one line naming the key, the dotted path and the fix.
    """
    params_dtype(cfg.precision.name)
    check_fp8_config(cfg.precision)
    label = scaler_label(build_loss_scaler(cfg.loss_scaler, cfg.precision.name))
    check_max_consecutive_skips(cfg.loss_scaler.max_consecutive_skips)
    check_lr_scheduler(cfg.optim, train_iters_of(cfg.train, seq_length=cfg.model.seq_length),
                       optimizer=check_optimizer(cfg.optim), train_samples=cfg.train.train_samples,
                       global_batch_size=cfg.train.global_batch_size, rampup_batch_size=cfg.train.rampup_batch_size,
                       step_batch_size_schedule=cfg.train.step_batch_size_schedule)
    # the strategy's own rules, then the wrapper it selects (the dp = 1 fallback to no_shard is the runtime's)
    check_fully_sharded(cfg)
    wrapper_target(cfg.precision, cfg.parallel.use_distributed_optimizer, sharding_strategy=sharding_strategy(cfg.parallel))
    check_overlap_param_gather(cfg.parallel)  # its rules live with the param all-gather
    return label


def check_train_length(train, *, seq_length: Optional[int] = None) -> None:
    """One of train.train_iters and train.train_samples (Megatron's iteration- or sample-based training); both
    only where train_iters is the one train_samples derives (`train_iters_of`: a run's own config.yaml records it;
    ``seq_length``: model.seq_length, needed with train.step_batch_size_schedule).

    Raises:
        ConfigError: both set and disagreeing, neither set, or train_samples < 0.
    """
    both = train.train_iters is not None and train.train_samples is not None
    if both and train.train_iters != train_iters_of(train, seq_length=seq_length):
        raise ConfigError(f"train.train_iters={train.train_iters} and train.train_samples={train.train_samples} are "
                          "both set; train by samples with train.train_iters=null, or set train.train_samples=null")
    if train.train_iters is None and train.train_samples is None:
        raise ConfigError("train.train_iters=null needs train.train_samples=<samples>; set one of them")
    if train.train_samples is not None and train.train_samples < 0:
        raise ConfigError(f"train.train_samples={train.train_samples} must be >= 0")


def check_training_keys(cfg: Config) -> None:
    """Iteration counts, intervals and checkpoint keys.

    Raises:
        ConfigError: non-positive counts/intervals/timeouts; keep_last_n < 0; clip_grad < 0 or not finite;
            load_iteration < 0 or without checkpoint.load; exit_interval or save_interval without
            checkpoint.save; manual_gc_interval < 0.
    """
    t, ck = cfg.train, cfg.checkpoint
    if t.train_iters is not None and t.train_iters < 0:
        raise ConfigError(f"train.train_iters={t.train_iters} must be >= 0")
    _positive("train.log_interval", t.log_interval)
    _positive("train.eval_interval", t.eval_interval, allow_none=True)
    if t.eval_interval is not None:
        _positive("train.eval_iters", t.eval_iters)
    _positive("train.exit_interval", t.exit_interval, allow_none=True)
    if t.exit_duration_in_mins is not None and not 0 < t.exit_duration_in_mins < float("inf"):
        raise ConfigError(f"train.exit_duration_in_mins={t.exit_duration_in_mins} must be a number of minutes > 0, "
                          "or null (no time limit)")
    _positive("checkpoint.save_interval", ck.save_interval, allow_none=True)
    for key, seconds in (("train.timeout_s", t.timeout_s), ("train.step_timeout_s", t.step_timeout_s)):
        # the upper bound: gloo's timeout in int64 nanoseconds, the heartbeat's wait (threading.TIMEOUT_MAX)
        if seconds is not None and not 0 < seconds <= MAX_TIMEOUT_S:
            raise ConfigError(f"{key}={seconds} must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}"
                              + (" or null (no step timeout)" if "step" in key else ""))
    if not (t.clip_grad >= 0 and t.clip_grad != float("inf")):  # also rejects NaN
        raise ConfigError(f"train.clip_grad={t.clip_grad} must be a finite number >= 0 (0 = no clipping)")
    if ck.keep_last_n is not None and ck.keep_last_n < 0:
        raise ConfigError(f"checkpoint.keep_last_n={ck.keep_last_n} must be >= 1, or 0 / null (keep every checkpoint)")
    if ck.load_iteration is not None and ck.load_iteration < 0:
        raise ConfigError(f"checkpoint.load_iteration={ck.load_iteration} must be >= 0, or null (the folder's latest)")
    if ck.load_iteration is not None and not ck.load:
        raise ConfigError(f"checkpoint.load_iteration={ck.load_iteration} needs checkpoint.load=<folder>; set it, or "
                          "checkpoint.load_iteration=null")
    if t.manual_gc_interval < 0:
        raise ConfigError(f"train.manual_gc_interval={t.manual_gc_interval} must be >= 0 (0 = collect only at the start)")
    if t.timing_log_level not in (0, 1, 2):
        raise ConfigError(f"train.timing_log_level={t.timing_log_level} must be 0, 1 or 2")
    for key, value in (("train.exit_interval", t.exit_interval), ("checkpoint.save_interval", ck.save_interval)):
        if value is not None and ck.save is None:
            raise ConfigError(f"{key}={value} needs checkpoint.save=<folder> to save into; set it, or {key}=null")
    # keys that shape saves, set where nothing is saved: no effect, which the user did not mean
    for key, value, off in (("checkpoint.keep_last_n", ck.keep_last_n, "null"),
                            ("checkpoint.async_save", ck.async_save, "false")):
        if value and ck.save is None:
            value = str(value).lower() if isinstance(value, bool) else value  # as typed: true, not True
            raise ConfigError(f"{key}={value} has no effect without checkpoint.save=<folder>; set it, or {key}={off}")


def check_layout_free(cfg: Any) -> str:
    """The checks of `validate_config` that no parallel size or world size changes, run first: debug keys,
    model components, precision / loss scaler / optimizer / LR schedule, training, load, logger and data keys.

    First because a wrong value here fails every layout: after the layout's batch arithmetic it would be
    reported as that (``train.global_batch_size=8 is not divisible by ...``) in `mptrain.plan` and
    `mptrain.check`, which try layouts the user did not pick. Returns the resolved loss scaler's name.

    Raises:
        ConfigError: one line naming the key and the fix.
    """
    c = as_config(cfg)
    check_fault_config(c.debug)  # the debug.* rules live with the fault injector
    check_model_components(c.model)  # model provider + layer spec tree: import, interface, keywords
    check_rampup_batch_size(c.train)  # before the train length, which the ramp's iterations set
    check_step_batch_size_schedule(c.train, c.model.seq_length)  # so does a step schedule
    check_train_length(c.train, seq_length=c.model.seq_length)  # before the LR schedule, whose length it sets
    loss_scaler = resolve_loss_scaler(c)
    check_training_keys(c)
    check_load_keys(c)  # the load keys' rules live with the load
    check_logger_config(c)  # logger.mode, and the logger.loggers.* components (import, methods, keywords, packages)
    check_data_config(c.data)  # data._target_, data.tokenizer._target_, corpora, split (mptrain.data.provider)
    return loss_scaler


def validate_config(cfg: Any, world_size: int, *, world_size_flag: str = TORCHRUN_WORLD_SIZE_FLAG) -> DerivedLayout:
    """Check every DESIGN.md §5 combination and derive the layout; pure (no collectives, no I/O).

    Args:
        cfg: the composed config (`DictConfig` from Hydra, or a `Config`).
        world_size: number of processes (torchrun's WORLD_SIZE).
        world_size_flag: what sets it, in the fix of a world size the layout does not divide (torchrun's
            ``--nproc_per_node``; ``world_size`` for the planner).
    Returns:
        the `DerivedLayout` (dp size, num_microbatches, resolved schedule and loss scaler).
    Raises:
        ConfigError: the first problem found, one line naming the key(s), the values and the fix.
            Order: the checks no layout changes (`check_layout_free`), then layout sizes, the profiler's
            ranks, model shape, layer split, batch, schedule.
    """
    c = as_config(cfg)
    return derive_layout(c, world_size, loss_scaler=check_layout_free(c), world_size_flag=world_size_flag)


def derive_layout(cfg: Any, world_size: int, *, loss_scaler: str,
                  world_size_flag: str = TORCHRUN_WORLD_SIZE_FLAG) -> DerivedLayout:
    """`validate_config` after `check_layout_free` (which returned ``loss_scaler``): layout sizes, model shape,
    layer split, batch, schedule, the profiler's ranks. For a caller that tries many layouts of one config (`mptrain.planner`), which
    runs the layout-free checks once instead of once per candidate.

    Raises:
        ConfigError: as `validate_config`.
    """
    c = as_config(cfg)
    tp, pp, vpp, dp = check_parallel_sizes(c, world_size, world_size_flag=world_size_flag)
    check_profile_config(c.train, world_size)  # train.profile_ranks name ranks of this world
    check_model_config(c.model, c.parallel)  # model shape vs layout, model choices, layer split (layers/gpt.py)
    num_microbatches = check_batch(c, dp)
    schedule = check_schedule_at_each_batch(c, tp, pp, vpp, dp, num_microbatches=num_microbatches)
    sequence_parallel = bool(c.parallel.sequence_parallel and tp > 1)  # seq_length % tp: check_model_config
    # null: compiled where the run's device is CUDA (groups.py picks CUDA whenever it is available)
    compiled, _ = resolve_compile_layers(c.model, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if c.parallel.tp_comm_overlap and not (sequence_parallel and compiled):
        missing = [need for need, ok in (("tensor_model_parallel_size > 1", tp > 1),
                                         ("parallel.sequence_parallel=true", c.parallel.sequence_parallel),
                                         ("model.compile_layers=true", compiled)) if not ok]
        raise ConfigError(
            "parallel.tp_comm_overlap=true overlaps the sequence-parallel collectives inside compiled layers on CUDA GPUs "
            f"with NCCL; it also needs {' and '.join(missing)} (got tp={tp}); set those or parallel.tp_comm_overlap=false"
        )
    etp, ep, edp = expert_layout(world_size, tp, pp, c.parallel.expert_model_parallel_size,
                                 c.parallel.expert_tensor_parallel_size)
    return DerivedLayout(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        data_parallel_size=dp,
        num_microbatches=num_microbatches,
        schedule=schedule,
        sequence_parallel=sequence_parallel,
        loss_scaler=loss_scaler,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        expert_data_parallel_size=edp,
        context_parallel_size=c.parallel.context_parallel_size,
    )
