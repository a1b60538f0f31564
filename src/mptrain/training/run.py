"""`run(cfg)`: the pretrain flow of the design document, as one importable function.

init distributed → groups → model chunks per stage → Float16Module / DDP wrappers → optimizer +
LR scheduler → (checkpoint load) → data iterators → validation at iteration 0 → the loop
(forward_backward_func, finalize_model_grads, optimizer step, LR step, metrics) with periodic
validation and checkpoints → final test evaluation → layout.json → teardown in `finally`.

Every user error (`ConfigError`) is raised on every rank before the first collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
import traceback
from typing import Any, NoReturn, Optional

import numpy as np
import torch

from mptrain.config.schema import Config
from mptrain.config.schema import as_config
from mptrain.training.validate import validate_config
from mptrain.data.provider import build_provider, empty_split_reason, provider_target
from mptrain.data.tokenizers import build_tokenizer, check_vocab_size
from mptrain.distributed.ddp import DistributedDataParallel
from mptrain.distributed.finalize import finalize_model_grads
from mptrain.errors import ConfigError, StorageError, launch_rank_and_world, report_and_exit
from mptrain.groups import ParallelGroups, build_groups, init_distributed, read_dist_env
from mptrain.layers.gpt import build_model_chunks
from mptrain.layers.mappings import enable_tp_comm_overlap
from mptrain.layers.sharding import collect_shard_specs
from mptrain.optim.builders import build_optimizer_factory
from mptrain.optim.lr_scheduler import build_lr_scheduler
from mptrain.precision import params_dtype as precision_params_dtype
from mptrain.precision.module import Float16Module
from mptrain.distributed.distrib_optimizer import build_optimizer_wrapper
from mptrain.precision.optimizer import TooManySkippedStepsError
from mptrain.precision.scaler import build_loss_scaler
from mptrain.schedules import ScheduleSpec, ScheduleStats, build_schedule
from mptrain.training.batch import CheckedProvider
from mptrain.training.host_malloc import tune_cpu_malloc
from mptrain.training.manual_gc import ManualGC
from mptrain.training.memory import memory_snapshot
from mptrain.training.timers import Timers
from mptrain.training.step import FaultInjector, Trainer, chunk_needs_data, make_forward_step
from mptrain.training.interrupt import exit_interrupted, note_stop
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


def seed_host_rngs(seed: int, groups: ParallelGroups) -> None:
    """Seed Python's `random` and NumPy's global RNG as Megatron's ``_set_random_seed`` does
    (``seed + 100 * pp_rank``; torch is seeded with the same number by `init_rng_tracker`), so a
    user component drawing from them is reproducible. A resume then restores or re-derives them
    from the checkpoint (`mptrain.checkpoint.rng`)."""
    host_seed = (seed + 100 * groups.pp_rank) % 2**32
    random.seed(host_seed)
    np.random.seed(host_seed)


def build_model_and_optimizer(cfg: Config, groups: ParallelGroups, derived, *, vocab_size: int):
    """Model chunks wrapped as DDP(Float16Module(GPTModel)), the optimizer wrapper and the LR scheduler.

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
    chunks = []
    for chunk in raw_chunks:
        specs = collect_shard_specs(chunk)
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
                use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                gradient_accumulation_fusion=cfg.parallel.gradient_accumulation_fusion,
            )
        )
    scaler = build_loss_scaler(cfg.loss_scaler, cfg.precision.name)
    optimizer = build_optimizer_wrapper(
        cfg.precision, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        build_optimizer=build_optimizer_factory(cfg.optim), model_chunks=chunks, groups=groups, scaler=scaler,
        clip_grad=cfg.train.clip_grad, max_consecutive_skips=cfg.loss_scaler.max_consecutive_skips)
    lr_scheduler = build_lr_scheduler(cfg.optim, optimizer, train_iters=cfg.train.train_iters)
    return chunks, optimizer, lr_scheduler, rng_tracker, scaler


def _data_iterators(provider: CheckedProvider, chunks: list, groups: ParallelGroups, make, with_mask: bool) -> list:
    """One iterator per chunk: real on the TP-rank-0 reader of a chunk that needs data, None elsewhere."""
    return [make() if (groups.tp_rank == 0 and chunk_needs_data(c, with_mask)) else None for c in chunks]


def build(cfg: Config, groups: ParallelGroups, derived, tokenizer, vocab_size: int) -> Built:
    """Everything a job needs, built collectively on every rank."""
    chunks, optimizer, lr_scheduler, rng_tracker, scaler = build_model_and_optimizer(cfg, groups, derived, vocab_size=vocab_size)
    with_mask = bool(cfg.data.reset_attention_mask)
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
                               seq_length=cfg.model.seq_length, vocab_size=vocab_size, with_attention_mask=with_mask)
    faults = FaultInjector(rank=groups.rank, fail_rank=cfg.debug.fail_rank, fail_iteration=cfg.debug.fail_iteration,
                           fail_where=cfg.debug.fail_where, fail_kind=cfg.debug.fail_kind,
                           attempt=read_dist_env().restart_count)
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
            faults=faults,
            timers=timers,
        ),
        finalize_model_grads=finalize_model_grads,
        device=groups.device,
        stats=ScheduleStats(timers=timers),
        timers=timers,
        faults=faults,
        # null: deferred where the device runs ahead of the host (CUDA); the CPU's work is synchronous
        defer_step_read=(groups.device.type == "cuda" if cfg.train.defer_step_read is None
                         else bool(cfg.train.defer_step_read)),
    )
    return Built(cfg=cfg, groups=groups, trainer=trainer, provider=provider, chunks=chunks, rng_tracker=rng_tracker,
                 scaler=scaler)


def _poison_grads_fn(built: Built, iteration_ref: list):
    """debug.nonfinite_grad_*: make the grads of that rank's model-parallel position non-finite at the
    given iteration, after the DP reduction, on every data-parallel replica of it (where a NaN in one
    rank's local grads lands once the DP all-reduce has summed it in; poisoning one replica only
    would be a fault the DP reduction cannot produce, and under ZeRO-1 it could miss the shard
    owner)."""
    dbg = built.cfg.debug
    if dbg.nonfinite_grad_rank is None or dbg.nonfinite_grad_rank not in built.groups.ranks["dp"]:
        return None

    def poison():
        if iteration_ref[0] == dbg.nonfinite_grad_iteration:
            for chunk in built.chunks:
                for _, _, grad in chunk.named_main_grads()[:1]:
                    grad.fill_(float("nan"))

    return poison


class _StepTimeout:
    """``train.step_timeout_s`` as the collective timeout of every group (`ParallelGroups.set_timeout`)
    from the end of this process's first step (which may compile / autotune under
    ``train.timeout_s``) to the last training step. Evaluation and checkpoint saves run under
    ``train.timeout_s`` (`suspended`): one rank may legitimately take longer there (rank 0 publishes
    and prunes checkpoints; uneven shards) while its peers wait in a collective."""

    def __init__(self, groups: ParallelGroups, timeout_s: float, step_timeout_s: Optional[float]) -> None:
        self.groups, self.timeout_s, self.step_timeout_s = groups, timeout_s, step_timeout_s
        self.on = False

    def start(self) -> None:
        if self.step_timeout_s is not None:
            self.groups.set_timeout(self.step_timeout_s)
            self.on = True

    def end(self) -> None:
        if self.on:
            self.groups.set_timeout(self.timeout_s)
            self.on = False

    @contextlib.contextmanager
    def suspended(self):
        if not self.on:
            yield
            return
        self.groups.set_timeout(self.timeout_s)
        try:
            yield
        finally:
            self.groups.set_timeout(self.step_timeout_s)


@dataclasses.dataclass
class _Row:
    iteration: int
    consumed: int
    outcome: Any  # training.step.IterationOutcome
    t_begin: float  # time.time() when its train_step began
    step_time_s: Optional[float] = None  # until the next iteration begins (or a flush): the iteration period


class _TrainRows:
    """The loop's metrics.jsonl rows, written in iteration order once their iteration is settled
    (``train.defer_step_read``: by the next `Trainer.train_step`) and its time is known.

    An iteration's time (the row's tokens/s) is the wall time from the start of its train_step to the
    start of the next one, or to a flush before an evaluation, a save or the end (which it excludes):
    the period at which iterations go through, as Megatron's interval timer. The duration of a
    train_step call alone is not: with a deferred read the wait for the device falls in the next one.
    """

    def __init__(self, recorder, trainer: Trainer, stop: StopSignal) -> None:
        self.recorder, self.trainer, self.stop = recorder, trainer, stop
        self.waiting: list[_Row] = []
        self.t_begin = time.time()

    def begin(self) -> None:
        """An iteration starts now: this ends the previous one's time, and writes its row if it is settled."""
        self.t_begin = time.time()
        self._close(self.t_begin)
        self._write_ready()

    def add(self, iteration: int, consumed: int, outcome) -> None:
        """Queue the iteration that just ran; write every row that is ready."""
        self.waiting.append(_Row(iteration, consumed, outcome, self.t_begin))
        self._write_ready()

    def _write_ready(self) -> None:
        while self.waiting and self.waiting[0].outcome.is_settled and self.waiting[0].step_time_s is not None:
            self._write(self.waiting.pop(0))

    def flush(self) -> None:
        """Settle every waiting row (a host sync), end the current iteration's time there, write them."""
        for row in self.waiting:
            row.outcome.metrics()
        self._close(time.time())
        while self.waiting:
            self._write(self.waiting.pop(0))

    def _close(self, now: float) -> None:
        if self.waiting and self.waiting[-1].step_time_s is None:
            self.waiting[-1].step_time_s = now - self.waiting[-1].t_begin
            self.stop.step_time_s = self.waiting[-1].step_time_s  # the stop signal's grace scales with it

    def _write(self, row: _Row) -> None:
        self.recorder.train_row(row.iteration, row.consumed, row.outcome.metrics(), self.trainer,
                                step_time_s=row.step_time_s)

    @contextlib.contextmanager
    def written_on_failure(self):
        """A training step that raises still leaves the rows of the iterations before it (best effort:
        a row that cannot be settled any more is dropped; the step's own error is what propagates)."""
        try:
            yield
        except BaseException:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - e.g. the skip limit, or a device error: the first error wins
                self.waiting.clear()
            raise


def run(cfg: Any) -> dict:
    """Train one job described by `cfg` (a Hydra DictConfig or a `Config`); returns the job's summary.

    Raises:
        ConfigError: invalid config (on every rank, before any collective).
    """
    from mptrain.training.recorder import Recorder

    t_start = time.time()
    env = read_dist_env()
    try:
        cfg = as_config(cfg)
        derived = validate_config(cfg, env.world_size)
    except ConfigError as err:
        if not hasattr(err, "symmetric"):  # config + world size only: every rank raises the same line
            err.symmetric = True  # (rank 0 prints it); an environment-dependent one says symmetric=False
        raise
    _check_checkpoint_paths(cfg)
    tokenizer = build_tokenizer(cfg.data)
    vocab_size = check_vocab_size(cfg.model.vocab_size, tokenizer.vocab_size)
    if cfg.precision.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device = init_distributed(env, timeout_s=cfg.train.timeout_s)
    if device.type == "cpu" and cfg.run.cpu_malloc_tuning:
        tune_cpu_malloc()  # no page faults re-growing the heap every step (training/host_malloc.py)
    groups = build_groups(
        derived.tensor_model_parallel_size,
        derived.pipeline_model_parallel_size,
        derived.virtual_pipeline_model_parallel_size,
        device=device,
    )
    recorder = None
    stop = StopSignal()
    # the rank heartbeat (training/watchdog.py): armed around each step from this process's second on
    heartbeat = StepWatchdog(cfg.train.step_timeout_s, rank=groups.rank) if cfg.train.step_timeout_s is not None else None
    clean_exit = False
    try:
        recorder = Recorder.open(cfg, groups, derived, vocab_size=vocab_size, t_start=t_start)
        built = build(cfg, groups, derived, tokenizer, vocab_size)
        trainer, provider = built.trainer, built.provider
        state = {"iteration": 0, "consumed_samples": 0}
        if cfg.checkpoint.load or cfg.checkpoint.save:
            from mptrain.checkpoint import maybe_load_checkpoint, save_checkpoint

            state = maybe_load_checkpoint(built, recorder)  # {"iteration", "consumed_samples"} (zeros when fresh)
        iteration, consumed = state["iteration"], state["consumed_samples"]
        recorder.start(iteration, built)  # logs the job, the kernels that run, the start-up time
        if iteration >= cfg.train.train_iters and iteration > 0:
            # nothing to train: exit 0 (the job is done), but say so rather than end silently
            recorder.log(f"checkpoint.load={cfg.checkpoint.load} is at iteration {iteration} >= train.train_iters="
                         f"{cfg.train.train_iters}: nothing to train; raise train.train_iters to continue")
        iteration_ref = [iteration]
        trainer.poison_grads = _poison_grads_fn(built, iteration_ref)
        with_mask = bool(cfg.data.reset_attention_mask)
        train_iters = _data_iterators(provider, built.chunks, groups, lambda: provider.train_iterator(consumed), with_mask)
        eval_on = cfg.train.eval_interval is not None and cfg.train.eval_iters > 0
        collector = ManualGC(cfg.train.manual_gc, cfg.train.manual_gc_interval, cfg.train.manual_gc_eval)
        step_timeout = _StepTimeout(groups, cfg.train.timeout_s, cfg.train.step_timeout_s)

        @contextlib.contextmanager
        def untimed_by_step_timeout():
            """Evaluation and saves: timed by neither the step timeout (`_StepTimeout.suspended`) nor a
            stop signal's grace (`StopSignal.untimed`)."""
            with stop.untimed(), step_timeout.suspended():
                yield

        def evaluate(split: str) -> None:
            """Write a `split` row at this iteration; a split that `data.split` left empty has no rows."""
            if not provider.has_split(split):
                return
            make = lambda: _data_iterators(provider, built.chunks, groups, lambda: provider.eval_iterator(split), with_mask)
            with untimed_by_step_timeout(), collector.evaluation():
                loss = trainer.evaluate(make, cfg.train.eval_iters)
            recorder.eval_row(split, iteration, loss)

        for split in ("valid", "test"):
            if eval_on and not provider.has_split(split):
                recorder.log(f"{empty_split_reason(cfg.data, split)}: no {split} rows")
        if eval_on and iteration == 0:
            evaluate("valid")
        stop.install()
        exit_code_reason = None
        rows = _TrainRows(recorder, trainer, stop)
        # debug.memory_snapshot: CUDA allocator history over the loop, dumped on rank 0 (training/memory.py)
        with memory_snapshot(cfg.debug.memory_snapshot, device=device, run_dir=recorder.run_dir, rank=groups.rank,
                             log=recorder.log), collector:
            while iteration < cfg.train.train_iters:
                rows.begin()  # first: the previous iteration's row is written before anything below can stall
                iteration_ref[0] = iteration + 1
                trainer.faults.iteration = iteration + 1
                # not the first step: it compiles / autotunes, and runs under the long start-up timeout
                armed = heartbeat is not None and iteration > state["iteration"]
                if armed:
                    heartbeat.arm(iteration + 1)
                if cfg.debug.sleep_rank == groups.rank and cfg.debug.sleep_seconds > 0 and iteration == 1:
                    time.sleep(cfg.debug.sleep_seconds)  # a rank stalled inside its step: the heartbeat is armed
                # this process's first step may compile / autotune for minutes: a signal's grace starts after it
                with stop.untimed() if iteration == state["iteration"] else contextlib.nullcontext():
                    with rows.written_on_failure():
                        outcome = trainer.train_step(train_iters)  # settles the previous iteration
                if armed:
                    heartbeat.disarm()  # evaluation and saves below may legitimately take long
                iteration += 1
                consumed += cfg.train.global_batch_size
                rows.add(iteration, consumed, outcome)
                collector.after_iteration(iteration)  # train.manual_gc: every rank at the same iteration
                if iteration == state["iteration"] + 1:
                    step_timeout.start()  # catches a stalled rank (DESIGN.md §5)
                evaluating = eval_on and iteration % cfg.train.eval_interval == 0 and iteration < cfg.train.train_iters
                stop_now = groups.any_rank(stop.received) if cfg.checkpoint.save else stop.received
                if stop_now:
                    stop.acknowledge()  # every rank got here: the save below may take its time
                exiting = cfg.train.exit_interval is not None and iteration >= cfg.train.exit_interval
                periodic = cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0
                last = iteration == cfg.train.train_iters
                saving = bool(cfg.checkpoint.save) and bool(periodic or exiting or stop_now or last)
                if evaluating or saving or exiting or stop_now or last:
                    rows.flush()  # this iteration's row before its evaluation row, its save, the end
                if evaluating:
                    evaluate("valid")
                if saving:
                    trainer.faults.maybe_fail("save")
                    with untimed_by_step_timeout():
                        save_checkpoint(built, iteration=iteration, consumed_samples=consumed, recorder=recorder)
                if exiting or stop_now:
                    exit_code_reason = "exit_interval" if exiting else "signal"
                    break
        if cfg.checkpoint.save:
            from mptrain.checkpoint.api import wait_for_saves

            wait_for_saves(built, recorder)  # checkpoint.async_save: the last save is published before the end
        step_timeout.end()  # no more training steps: the final evaluation and the layout gather
        if exit_code_reason is None and eval_on and iteration > state["iteration"]:
            evaluate("valid")
            evaluate("test")
        result = recorder.finish(built, iteration=iteration, stopped=exit_code_reason)
        if exit_code_reason == "signal":  # the entry point's last line and exit code (training/interrupt.py)
            note_stop(stop.signum, iteration=iteration, save=cfg.checkpoint.save, saved=bool(cfg.checkpoint.save))
        clean_exit = True
        return result
    except (ConfigError, StorageError, TooManySkippedStepsError) as err:
        # raised alike on every rank (validation, data, checkpoint shape, a failed save, skips): no peer
        # waits; a StorageError of rank 0's metrics writes is this rank's alone (all_ranks False)
        clean_exit = getattr(err, "all_ranks", True)
        raise
    finally:
        stop.uninstall()
        if recorder is not None:
            recorder.close()
        # After a failure on this rank the communicators are left alone (destroying an NCCL group
        # while a peer waits in a collective hangs): the process exits and torchrun stops the others.
        if clean_exit:
            groups.destroy()
        if heartbeat is not None:
            heartbeat.stop()  # last: after a failure mid-step it stays armed through this cleanup


def _check_checkpoint_paths(cfg: Config) -> None:
    """Checkpoint folders that cannot work, rejected before any collective (not at the first save).

    Raises:
        ConfigError: `checkpoint.save` is an existing file; `checkpoint.load` does not exist and is
            not also the save folder (resuming into the folder a job saves to is the usual
            restart pattern, and starts fresh on the first attempt).
    """
    from pathlib import Path

    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    if save and Path(save).exists() and not Path(save).is_dir():
        raise ConfigError(f"checkpoint.save={save} is a file, not a folder; pick another checkpoint.save")
    if load and not Path(load).exists() and (not save or Path(load).resolve() != Path(save).resolve()):
        raise ConfigError(
            f"checkpoint.load={load} does not exist; fix the path, or set checkpoint.load to the checkpoint.save "
            "folder to resume when it exists and start fresh otherwise"
        )


def exit_on_config_error(err: BaseException) -> NoReturn:
    """Print ``err`` as one ``error: ...`` line and exit 1 (never returns; `report_and_exit`).

    A start-up config error (`validate_config`: config + world size only; ``err.symmetric``) and the
    skip limit (decided by an all-reduce) are the same on every rank: rank 0 alone prints it, so a
    torchrun job shows one line, not one per rank. Other errors may differ between ranks (a file one
    node lacks, an unset ``${oc.env:...}``): every failing rank prints its own at once and exits
    after `mptrain.errors.CONFIG_ERROR_GRACE_S`.
    """
    try:
        env = read_dist_env()
        rank, world_size = env.rank, env.world_size
    except ConfigError:  # the launch environment is itself the error (a SLURM node list nothing can parse)
        rank, world_size = launch_rank_and_world()
    symmetric = getattr(err, "symmetric", False) or isinstance(err, TooManySkippedStepsError)
    report_and_exit(f"error: {err}", rank=rank, world_size=world_size, symmetric=symmetric)


def hydra_main(cfg) -> Any:
    """The task function of train.py.

    Single run: a `ConfigError` prints one line to stderr and exits 1 (no traceback); any other
    failure prints the traceback with the rank and exits 1 at once, without a collective teardown
    (torchrun then stops the other ranks; a hang is never the answer). In a multirun the
    exception propagates to the sweep callback, which records it (`mptrain.training.sweep`).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun:
        return run(cfg)  # the sweep callback records and applies the policy
    try:
        result = run(cfg)
        # a clean end: release the default group too (`ParallelGroups.destroy` keeps it for the test pool
        # and a sweep's next job); left to interpreter exit, gloo's threads can abort the process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return result
    except (ConfigError, StorageError, TooManySkippedStepsError) as err:  # one line, exit 1
        exit_on_config_error(err)
    except KeyboardInterrupt:  # Ctrl-C before the loop's stop handler took over SIGINT: one line, exit 130
        exit_interrupted(None)
    except BaseException as err:  # noqa: BLE001
        if isinstance(err, SystemExit) and not err.code:
            raise
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        print(f"[rank {rank}] job failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
