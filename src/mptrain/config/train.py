"""Schemas of the `train`, `checkpoint`, `run`, `logger` and `debug` nodes (DESIGN.md §1, §2)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from mptrain.config.batch_size import BatchSizeSchedule


def train_iters_of(train, *, seq_length: Optional[int] = None) -> Optional[int]:
    """The run's last iteration: ``train.train_iters``, or with ``train.train_samples`` set Megatron's
    ``update_train_iters``: train_samples // global_batch_size (a last partial batch is not trained), or with
    ``train.rampup_batch_size`` / ``train.step_batch_size_schedule`` its count (`BatchSizeSchedule.train_iters`;
    ``seq_length``: model.seq_length, which turns a step schedule's token thresholds into samples)."""
    if train.train_samples is None:
        return train.train_iters
    return BatchSizeSchedule.of(train, seq_length=seq_length).train_iters(train.train_samples)


@dataclasses.dataclass
class TrainConfig:
    train_iters: Optional[int] = 20
    """The last iteration (iterations count completed optimizer steps from 1, skipped ones included); null
    with train_samples, which then sets it (`train_iters_of`; config.yaml records the derived value)."""
    train_samples: Optional[int] = None
    """Megatron's --train-samples: train by samples instead: iterations = train_samples // global_batch_size
    (with rampup_batch_size / step_batch_size_schedule: Megatron's count over it, `train_iters_of`), and the LR schedule counts samples (optim.lr_warmup_samples / lr_decay_samples, or lr_warmup_fraction).
    null = train by train_iters. Needs train.train_iters=null (both set is an error, as in Megatron, unless train_iters is the derived value)."""
    exit_interval: Optional[int] = None
    """Save a checkpoint and exit 0 after this iteration."""
    exit_duration_in_mins: Optional[float] = None
    """Megatron's --exit-duration-in-mins: after the first iteration that ends more than this many minutes
    after the job started (on any rank: the ranks agree through a MAX all-reduce each iteration, as Megatron),
    save a checkpoint (with checkpoint.save) and exit 0. > 0; null = no time limit."""
    micro_batch_size: int = 2
    """Samples per micro-batch per DP rank."""
    global_batch_size: int = 8
    """Samples per iteration over all DP ranks; must be divisible by micro_batch_size × dp. With
    rampup_batch_size: the batch the ramp ends at. With step_batch_size_schedule: not the training batch; the
    evaluation's global batch and the samples of one iteration where an LR length counts iterations
    (Megatron takes micro_batch_size × dp there, `mptrain.config.batch_size`)."""
    rampup_batch_size: Optional[List[int]] = None
    """Megatron's --rampup-batch-size: [start, increment, ramp_samples]: the global batch starts at start
    and grows by increment every ramp_samples / ((global_batch_size - start) / increment) consumed samples
    until it reaches global_batch_size (`mptrain.config.batch_size`); each reached batch must be a multiple
    of micro_batch_size × dp. Needs train.train_samples (iterations: Megatron's update_train_iters); the LR
    schedule then counts the samples of each applied step. null = a constant global batch."""
    step_batch_size_schedule: Optional[str] = None
    """Megatron's --step-batch-size-schedule: "THRESHOLD:BATCH THRESHOLD:BATCH ...", e.g. "0:16 2.4B:320 12B:1536":
    from THRESHOLD tokens trained (K / M / B / T = 10^3 / 10^6 / 10^9 / 10^12; tokens // model.seq_length
    samples) the global batch is BATCH (`mptrain.config.batch_size`). The first threshold is 0; each reached
    batch a multiple of micro_batch_size × dp, never decreasing. Training by train_iters or train_samples
    (iterations: Megatron's update_train_iters, the last batch trained whole); the LR schedule counts the
    samples of each applied step. One string (spaces or commas between entries; quote it on the command
    line: 'train.step_batch_size_schedule="0:16 2.4B:320"'). Not with rampup_batch_size. null = off."""
    seed: int = 1234
    """Init and dropout seed."""
    clip_grad: float = 1.0
    """Global grad-norm clip (0 = off)."""
    log_interval: int = 1
    """A console (and train.log) step line every N iterations and on the last, reporting its interval as
    Megatron's --log-interval: the mean lm_loss and grad norm over the non-skipped iterations since the
    previous line, the mean time per iteration and the tokens/s, TFLOP/s/GPU and MFU from it, the skipped
    and nan iterations. metrics.jsonl gets every iteration's own row either way."""
    eval_interval: Optional[int] = 10
    """Validate every N iterations (and at iteration 0); null = no evaluation."""
    eval_iters: int = 2
    """Global batches per evaluation."""
    timeout_s: float = 600.0
    """Collective timeout for start-up."""
    step_timeout_s: Optional[float] = None
    """Seconds; null = off (timeout_s throughout, no heartbeat). After the first step (which compiles and
    autotunes under timeout_s): the collective timeout of every process group, so a peer that died or
    stalled makes this rank's collectives fail (NCCL's watchdog / gloo raise); and a per-rank heartbeat
    (training/watchdog.py) that ends a training step still running after step_timeout_s +
    max(10, step_timeout_s) seconds with one stderr line and exit 1, when the collective timeout did not
    end the process. Evaluation and checkpoint saves are timed by neither: they run under timeout_s."""
    defer_step_read: Optional[bool] = None
    """Read each iteration's loss, grad norm and skip decision on the host one iteration late, after
    the next forward-backward is enqueued, so that the accelerator never waits for the host between
    steps (the skip decision itself stays on the device: fused Adam / AdamW's found_inf). Exact: the
    same updates, LR schedule and metrics.jsonl rows. Applies to the folded step (bf16 / fp32, no loss
    scaler, a fused Adam / AdamW); other runs read at once. null (default): on where the device runs
    ahead of the host (CUDA), off on the CPU (its work is synchronous: nothing to overlap); true /
    false: on / off everywhere. While on, a skip-limit error surfaces one forward-backward later and a
    process killed mid-step (SIGKILL, the heartbeat) loses the row of the iteration before it (a step
    that raises does not)."""
    manual_gc: bool = False
    """Turn Python's automatic garbage collection off for the training loop and collect at fixed
    iterations instead, the same on every rank (Megatron's ``--manual-gc``;
    `mptrain.training.manual_gc`): no collection pause on one rank that its peers wait for."""
    manual_gc_interval: int = 0
    """With manual_gc: a full collection every N iterations (0 = only at the start of the loop)."""
    manual_gc_eval: bool = True
    """With manual_gc: a collection before and after each evaluation (Megatron's ``--no-manual-gc-eval`` = false)."""
    profile: bool = False
    """Megatron's --profile: profile the iterations after profile_step_start up to and including
    profile_step_end (the profiler starts once profile_step_start iterations are done and stops once
    profile_step_end are), on the ranks in profile_ranks (`mptrain.training.profiler`)."""
    profile_step_start: int = 10
    """Megatron's --profile-step-start: completed iterations before the profiler starts (>= 0)."""
    profile_step_end: int = 12
    """Megatron's --profile-step-end: completed iterations when it stops (> profile_step_start)."""
    profile_ranks: List[int] = dataclasses.field(default_factory=lambda: [0])
    """Megatron's --profile-ranks: the global ranks that profile (each in [0, world size))."""
    use_pytorch_profiler: bool = False
    """Megatron's --use-pytorch-profiler: with profile, record with torch.profiler and write a Chrome
    trace (``rank<R>.iter<A>-<B>.pt.trace.json``, TensorBoard's profiler reads it) into logger.tensorboard_dir,
    or run.dir when that is null. false: on CUDA, mark the window for an outer ``nsys profile
    --capture-range=cudaProfilerApi`` (cudaProfilerStart / Stop, with NVTX ranges per op); on CPU
    torch.profiler records either way. Needs profile=true."""
    timing_log_level: int = 1
    """Megatron's timing levels: 0 = iteration time only; 1 = + forward-backward, grads-all-reduce,
    optimizer, batch-generator, pipeline-p2p; 2 = fine-grained (none yet). Timers above this level cost
    nothing (levels: `training.timers.TIMER_LEVELS`)."""


@dataclasses.dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Folder for checkpoints; null = no saving."""
    load: Optional[str] = None
    """Folder to resume from (its `latest`); null = start fresh."""
    load_iteration: Optional[int] = None
    save_interval: Optional[int] = None
    keep_last_n: Optional[int] = None
    finetune: bool = False
    """Megatron's --finetune: load only the weights of `checkpoint.load` (model + fp32 main params);
    iteration, consumed samples, optimizer state, loss scaler, LR schedule and RNG start fresh (the run
    starts at iteration 1 on the new data and schedule). To resume a fine-tuning job that saved its own
    checkpoints, drop finetune and load from its checkpoint.save."""
    load_optim: bool = True
    """Megatron's --no-load-optim when false: resume (iteration, consumed samples, LR schedule, RNG) but
    start the optimizer state and the loss scaler fresh; the way to change the optimizer class
    (optim._target_) or its state shapes on resume, which load_optim=true refuses."""
    load_rng: bool = True
    """Megatron's --no-load-rng when false: do not restore the saved RNG states; re-derive them from
    (train.seed, the iteration, the rank's coordinates), as when the layout changed."""
    use_checkpoint_args: Optional[bool] = None
    """Megatron's --use-checkpoint-args: the model's architecture keys (layers, widths, heads, vocab, norm,
    RoPE, biases, tie; not seq_length or dropout) come from checkpoint.load's saved config, over the
    command line's; data.tokenizer and checkpoint.hf_config too, unless the command line sets them (a
    differing tokenizer: one warning) (`mptrain.checkpoint.args`). null = as the checkpoint says: true for
    one imported with `python -m mptrain.export --import-hf` or `--import-megatron` (and for the
    checkpoints of a run that took its model so), false otherwise."""
    hf_config: Optional[Dict[str, Any]] = None
    """What `python -m mptrain.export --format hf` writes into the Hugging Face config.json besides the
    architecture: {model_type, bos_token_id, eos_token_id} (an id or a list of ids). Set by
    `--import-hf` from the source config.json and taken from checkpoint.load with the model
    (use_checkpoint_args), so every checkpoint the run saves carries it; null = none (a model trained from
    scratch: the export writes the tokenizer's EOD as bos and eos)."""
    async_save: bool = False
    """Training blocks only while the state is copied to host memory; a background thread writes,
    checksums and publishes it (`latest` after it completed); the next save and the end of the run wait
    for it. Needs host memory for one copy of the checkpointed state."""


@dataclasses.dataclass
class RunConfig:
    dir: Optional[str] = None
    """Run folder; null = outputs/<model>-<parallel>-<precision> (a sweep: the sweep root,
    null = a fresh outputs/multirun[-N], each job in a subfolder named by its swept keys). `${run.dir}`
    resolves to the folder the run (or the sweep job) uses, also when this is null."""
    progress_bar: Optional[bool] = None
    """Console: a progress bar (true), a plain line per train.log_interval (false); null = a bar on
    interactive terminals only."""
    peak_tflops_per_gpu: Optional[float] = None
    """Peak dense TFLOP/s per accelerator for MFU; null = 989 on H100/H200, MFU null when unknown (CPU)."""
    cpu_malloc_tuning: bool = False
    """Off by default. true: on the CPU, fix glibc malloc's mmap / trim thresholds so that each step
    reuses the memory the previous one freed instead of page-faulting it back in
    (`mptrain.training.host_malloc`); skipped when the environment already sets MALLOC_* thresholds
    or preloads another allocator. No effect on GPU runs."""


@dataclasses.dataclass
class LoggerConfig:
    """Experiment loggers (components: `mptrain.training.loggers`). metrics.jsonl and train.log are always written."""

    name: str = "none"
    """The option file selected (none | wandb | tensorboard; with `logger=[wandb,tensorboard]` the last one)."""
    loggers: Dict[str, Any] = dataclasses.field(default_factory=dict)
    """key → component node (`_target_` + the target's own keys); every node is built on rank 0, e.g.
    `{wandb: {_target_: mptrain.training.loggers.WandbLogger}}`; empty = none."""
    project: str = "mptrain"
    """wandb project (passed to every logger whose constructor takes `project`)."""
    mode: str = "offline"
    """wandb: online | offline | disabled (passed as `mode`)."""
    entity: Optional[str] = None
    """wandb: team or user; null = the wandb default."""
    run_name: Optional[str] = None
    """The run's display name (passed as `name`); null = the run folder's name."""
    group: Optional[str] = None
    """wandb: run group (e.g. one per sweep); null = none."""
    tags: List[str] = dataclasses.field(default_factory=list)
    """wandb: run tags."""
    tensorboard_dir: Optional[str] = None
    """Megatron's --tensorboard-dir: the folder TensorBoard event files go to (a relative path is under the
    working directory, as Megatron's); null = `<run.dir>/tensorboard`. Needs a TensorBoard logger
    (logger=tensorboard or logger=[wandb,tensorboard]): set without one it is an error."""


@dataclasses.dataclass
class DebugConfig:
    fail_rank: Optional[int] = None
    fail_iteration: Optional[int] = None
    fail_where: str = "forward"
    """forward | data | save (before the save starts) | save_write (inside the save: iter_N.tmp exists,
    this rank's shards are not written)."""
    fail_kind: str = "raise"
    """raise (RuntimeError) | sigkill (the rank SIGKILLs itself). Either fires on torchrun's first attempt
    only (TORCHELASTIC_RESTART_COUNT=0), so a restarted job runs through."""
    nonfinite_grad_rank: Optional[int] = None
    nonfinite_grad_iteration: Optional[int] = None
    sleep_rank: Optional[int] = None
    sleep_seconds: float = 0.0
    memory_snapshot: bool = False
    """CUDA only: record allocation history and dump a pickle into the run folder on rank 0."""
