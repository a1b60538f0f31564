"""The run's record: run folder, metrics.jsonl rows, throughput, layout.json, the job summary.

Glue between the loop (`mptrain.training.run`) and the writers that own each file (`mptrain.runs`:
the run folder and the sweep summary; `metrics`, `layout`, `throughput`). Only rank 0 writes; every
rank calls the same methods, and the collective ones (claiming the run folder, gathering layout.json)
are marked.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

from mptrain.config.batch_size import BatchSizeSchedule
from mptrain.config.schema import config_to_container
from mptrain.distributed.fsdp_optimizer import local_shard
from mptrain.distributed.held_bytes import aliases_param, held_bytes, strategy_line
from mptrain.distributed.strategy import running_strategy, sharding_strategy
from mptrain.errors import ConfigError
from mptrain.layers.compile import compile_reason, compile_seconds
from mptrain.layers.cp_blocks import RING_DOCUMENTS_NOTE
from mptrain.layers.document_mask import describe_document_attention
from mptrain.layers.embedding import padded_vocab_size
from mptrain.layers.moe.experts import describe_experts
from mptrain.layers.params import flops_per_iteration
from mptrain.precision.module import unwrap
from mptrain.runs.claim import claim_run_dir
from mptrain.runs.summary import JobResult, eval_summary
from mptrain.training.layout import IterationCounters, RankFacts, gather_and_write_layout, tensor_bytes
from mptrain.training.loggers import LoggerGroup, build_loggers, logged_metrics
from mptrain.training.metrics import EvalRow, MetricsWriter, TrainRow, read_metrics
from mptrain.training.throughput import memory_allocated_gib, peak_memory_gib, peak_tflops_per_gpu, throughput

log = logging.getLogger("mptrain")


def kernels_line(built) -> str:
    """``kernels: optimizer=<class> (<kernel>)[ weight_decay=W coupled (...) | decoupled (...)] norm=<class> (<kernel>)``:
    the inner optimizer the wrapper steps (`mptrain.optim.optimizer_kernel`: torch fused / foreach / for-loop, or
    apex's class), how it applies weight decay when it decays (`mptrain.optim.weight_decay_note`: torch's Adam
    is L2, Megatron's adam is AdamW), the
    norm nodes of this rank's layers (``*_layernorm`` modules, `mptrain.layers.norms.describe_norm`), the MoE
    experts' GEMMs (`mptrain.layers.moe.experts.describe_experts`: grouped_mm or the per-expert loop) and, with
    ``data.reset_attention_mask``, how attention masks documents (`attention_note`)."""
    from mptrain.layers.norms import describe_norm
    from mptrain.optim import optimizer_kernel, weight_decay_note

    wrapper = built.trainer.optimizer
    inner = getattr(wrapper, "optimizer", wrapper)  # a user wrapper may not expose an inner optimizer
    norms = dict.fromkeys(describe_norm(module) for chunk in built.chunks for name, module in chunk.named_modules()
                          if name.rsplit(".", 1)[-1].endswith("layernorm"))
    fp8 = getattr(built, "fp8", None)  # precision=fp8: what runs in FP8 (`mptrain.layers.fp8.Fp8Summary`)
    return (f"kernels: optimizer={optimizer_kernel(inner)}{weight_decay_note(inner)} "
            f"norm={', '.join(norms) or 'none on this rank'}"
            f"{describe_experts(built.chunks)}{attention_note(built.cfg, built.groups.device)}{compile_note(built.chunks)}"
            f"{fp8.describe() if fp8 is not None else ''}")


def attention_note(cfg, device) -> str:
    """`` attention=documents (<backend>)`` with ``data.reset_attention_mask`` (training's backend on ``device``:
    `mptrain.layers.document_mask.describe_document_attention`; under ``cp_comm_type=p2p`` the ring's blocks,
    `mptrain.layers.cp_blocks`), `` attention=dense [b,1,s,s] mask (...)`` when
    ``data.create_attention_mask_in_dataloader`` asks for it, else nothing (plain causal)."""
    if not cfg.data.reset_attention_mask:
        return ""
    if cfg.data.create_attention_mask_in_dataloader:
        return " attention=dense [b,1,s,s] mask (data.create_attention_mask_in_dataloader=true)"
    if cfg.parallel.context_parallel_size > 1 and cfg.parallel.cp_comm_type == "p2p":
        return RING_DOCUMENTS_NOTE
    model = cfg.model
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    return describe_document_attention(device, head_dim=head_dim, dropout_p=model.attention_dropout)


def batch_size_line(train, data_parallel_size: int, *, seq_length: int, shown: int = 6) -> str:
    """``batch-size ramp-up: ...`` / ``step batch-size schedule: ...``: the key (`mptrain.config.batch_size`) and the
    iterations at each global batch with their micro-batches per DP rank (the first and last runs when there are
    more than ``shown``)."""
    schedule = BatchSizeSchedule.of(train, seq_length=seq_length)
    per_step = train.micro_batch_size * data_parallel_size
    parts = [f"{r.first_iteration if r.iterations == 1 else f'{r.first_iteration}-{r.last_iteration}'}: "
             f"{r.global_batch_size} ({r.global_batch_size // per_step} mb)" for r in schedule.runs(train.train_iters)]
    if len(parts) > shown:
        parts = parts[:shown // 2] + [f"... {len(parts) - shown} more"] + parts[-(shown - shown // 2):]
    if schedule.step_batch_size_schedule is not None:
        entries = ", ".join(f"{batch} from sample {threshold}" for threshold, batch in schedule.step_batch_size_schedule)
        return (f'step batch-size schedule (train.step_batch_size_schedule="{train.step_batch_size_schedule}", '
                f"thresholds in tokens // model.seq_length={seq_length}): global batch {entries}; iterations "
                + ", ".join(parts))
    start, increment, ramp_samples = schedule.rampup_batch_size
    steps = (schedule.global_batch_size - start) // increment
    return (f"batch-size ramp-up (train.rampup_batch_size=[{start}, {increment}, {ramp_samples}]): global batch {start} "
            f"-> {schedule.global_batch_size} by {increment} every {ramp_samples / steps:g} samples; iterations "
            + ", ".join(parts))


def compile_note(chunks) -> str:
    """What ``model.compile_layers`` compiled in these (wrapped) chunks: `mptrain.layers.compile.compile_reason`."""
    return compile_reason([unwrap(chunk) for chunk in chunks])


def finished_summary(run_dir: str | Path, derived) -> dict:
    """The job summary (JobResult fields) of a finished run relaunched: what its metrics.jsonl recorded (the
    last train row's loss, the validation numbers); nothing is measured, nothing written."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("split") == "train"]
    result = JobResult(layout=dataclasses.asdict(derived), final_loss=train[-1]["lm_loss"] if train else None,
                       run_dir=str(Path(run_dir).resolve()), **eval_summary(rows))
    return dataclasses.asdict(result)


@dataclasses.dataclass
class Recorder:
    cfg: Any
    groups: Any
    derived: Any
    run_dir: Path
    flops_per_iteration: int
    peak_tflops: Optional[float]
    t_start: float
    logger: LoggerGroup = dataclasses.field(default_factory=LoggerGroup)
    counters: IterationCounters = dataclasses.field(default_factory=IterationCounters)
    writer: Optional[MetricsWriter] = None
    pending: list = dataclasses.field(default_factory=list)
    last_loss: Optional[float] = None
    t_first_step: Optional[float] = None
    tokens_per_s: list = dataclasses.field(default_factory=list)

    @classmethod
    def open(cls, cfg, groups, derived, *, plan, vocab_size: int, t_start: float) -> "Recorder":
        """Claim the planned run folder (`plan`: `mptrain.runs.folder.RunDirPlan`; collective): rank 0
        creates it and writes config.yaml. A relaunch's resume line is the log's first."""
        run_dir = claim_run_dir(cfg, plan, rank=groups.rank, world_size=groups.world_size)
        m = cfg.model
        flops = flops_per_iteration(
            m,
            padded_vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, derived.tensor_model_parallel_size),
            tokens_per_iteration=cfg.train.global_batch_size * m.seq_length,
        )
        recorder = cls(cfg=cfg, groups=groups, derived=derived, run_dir=run_dir, flops_per_iteration=flops,
                       peak_tflops=peak_tflops_per_gpu(groups.device, cfg.run.peak_tflops_per_gpu), t_start=t_start)
        if plan.relaunch is not None:
            recorder.log(plan.relaunch.resume_line)
        return recorder

    def rates(self, elapsed_s: float, global_batch_size: Optional[int] = None):
        """tokens/s (world), tokens/s/GPU, TFLOP/s/GPU and MFU of one iteration (DESIGN.md §2 formula) of
        ``global_batch_size`` samples (default train.global_batch_size; a ramp or a step schedule varies it)."""
        full = self.cfg.train.global_batch_size
        batch = full if global_batch_size is None else global_batch_size
        # F is linear in the tokens T of the iteration: F(batch) = F(full) × batch / full
        return throughput(flops=self.flops_per_iteration * batch / full, tokens=batch * self.cfg.model.seq_length,
                          elapsed_s=elapsed_s, num_gpus=self.groups.world_size, peak_tflops=self.peak_tflops)

    @property
    def is_writer(self) -> bool:
        return self.groups.rank == 0

    def log(self, text: str, *, console: bool = True) -> None:
        """A line for train.log and, unless ``console`` is False (an error line the entry point prints), the
        console (rank 0; held until the writer opens)."""
        if not self.is_writer:
            return
        if self.writer is None:
            self.pending.append(text)
        else:
            self.writer.message(text, console=console)

    def start(self, start_iteration: int, built=None) -> None:
        """Open metrics.jsonl / train.log and build the experiment loggers (rank 0), after a checkpoint
        load decided the start iteration (a resumed wandb run / TensorBoard log continues from it).
        With ``built`` (`mptrain.training.run.Built`), a ``kernels:`` line says what runs (`kernels_line`)."""
        self.writer = MetricsWriter(
            self.run_dir,
            self.groups.rank,
            log_interval=self.cfg.train.log_interval,
            train_iters=self.cfg.train.train_iters,
            start_iteration=start_iteration,
            progress_bar=self.cfg.run.progress_bar,
            rates=self.rates,
            # the first interval's nan iterations count from the loaded checkpoint's total
            nan_iters_total=getattr(built.trainer.optimizer, "nan_iters_total", 0) if built is not None else 0,
        )
        for text in self.pending:
            self.writer.message(text)
        self.pending.clear()
        self.logger = self._build_loggers(start_iteration)
        d = self.derived
        # sequence parallelism splits what TP replicates: at tp = 1 the key is accepted and has no effect (as Megatron)
        sp = ("on" if d.sequence_parallel else
              "off (parallel.sequence_parallel=true has no effect at tp=1)" if self.cfg.parallel.sequence_parallel else "off")
        self.log(
            f"job: model={self.cfg.model.name} tp={d.tensor_model_parallel_size} pp={d.pipeline_model_parallel_size} "
            f"vpp={d.virtual_pipeline_model_parallel_size} dp={d.data_parallel_size} schedule={d.schedule} "
            f"precision={self.cfg.precision.name} micro-batches={d.num_microbatches} sequence-parallel={sp} "
            f"run.dir={self.run_dir}"
        )
        if BatchSizeSchedule.of(self.cfg.train, seq_length=self.cfg.model.seq_length).varies:
            self.log(batch_size_line(self.cfg.train, d.data_parallel_size, seq_length=self.cfg.model.seq_length))
        if built is not None:
            self.log(kernels_line(built))
            cp = self.cfg.parallel.context_parallel_size
            self.log(strategy_line(sharding_strategy(self.cfg.parallel), running_strategy(self.cfg,
                                   d.data_parallel_size * cp), d.data_parallel_size,
                                   held_bytes(built.chunks, built.trainer.optimizer), cp_size=cp,
                                   shard_size=self.cfg.parallel.data_parallel_shard_size,
                                   cpu_offload=self.cfg.optim.optimizer_cpu_offload))
            allocated = memory_allocated_gib(self.groups.device)
            if allocated is not None:  # Megatron's report_memory after setup: what the build itself left and peaked at
                self.log(f"memory after the model, optimizer and LR scheduler are built: allocated {allocated:.2f} "
                         f"GiB, max allocated {peak_memory_gib(self.groups.device):.2f} GiB (rank {self.groups.rank})")
            fp8 = getattr(built, "fp8", None)
            if fp8 is not None and fp8.warning() is not None:
                self.log(fp8.warning())
        self.log(f"startup: {time.time() - self.t_start:.1f} s to first iteration's setup")

    def _build_loggers(self, start_iteration: int) -> LoggerGroup:
        """`build_loggers` on rank 0, whose outcome every rank then learns (one broadcast): a logger that fails
        to build ends the job on every rank with rank 0's one line, where the others would otherwise wait in
        their next collective for a rank that is gone and fail with a traceback of their own.

        Raises:
            ConfigError: a logger failed to build (``symmetric``: rank 0 prints it); rank 0 raises its own error.
        """
        error: Optional[BaseException] = None
        logger = LoggerGroup()
        try:
            logger = build_loggers(self.cfg.logger, rank=self.groups.rank, run_dir=self.run_dir,
                                   run_config=config_to_container(self.cfg) if self.is_writer else None,
                                   start_iteration=start_iteration)
        except Exception as err:  # noqa: BLE001 - re-raised below, after every rank has heard of it
            error = err
        if self.groups.world_size > 1:
            box = [None if error is None else str(error)]
            torch.distributed.broadcast_object_list(box, src=0)
            if error is None and box[0] is not None:
                error = ConfigError(f"rank 0 could not build its loggers: {box[0]}")
        if error is not None:
            if isinstance(error, ConfigError):
                error.symmetric = True  # rank 0's line; the other ranks exit 1 without one
            raise error
        return logger

    def eval_row(self, split: str, iteration: int, loss: float) -> None:
        row = EvalRow(split=split, iteration=iteration, lm_loss=loss)
        self.writer.write_eval(row)
        self.logger.log_metrics(logged_metrics(row.as_dict()), step=iteration)

    def train_row(self, iteration: int, consumed: int, metrics: dict, trainer, *, step_time_s: float) -> None:
        if self.t_first_step is None:
            self.t_first_step = time.time()
            compiled_s = compile_seconds()  # Dynamo + Inductor, forward and backward graphs (and evaluation's)
            compiled = f", of which compile {compiled_s:.1f} s" if compiled_s > 0 else ""
            self.log(f"startup: {self.t_first_step - self.t_start:.1f} s to the end of the first step{compiled}")
        rates = self.rates(step_time_s, metrics["global_batch_size"])
        self.counters.end_iteration(metrics["num_microbatches"])
        if iteration > 1:  # the first step carries warm-up costs
            self.tokens_per_s.append(rates.tokens_per_s)
        self.last_loss = metrics["lm_loss"]
        row = TrainRow(
            iteration=iteration,
            consumed_samples=consumed,
            lm_loss=metrics["lm_loss"],
            lr=metrics["lr"],
            grad_norm=metrics["grad_norm"],
            loss_scale=metrics["loss_scale"],
            skipped_iter=metrics["skipped_iter"],
            skipped_iters_total=metrics["skipped_iters_total"],
            nan_iters_total=metrics["nan_iters_total"],
            global_batch_size=metrics["global_batch_size"],
            num_microbatches=metrics["num_microbatches"],
            tokens_per_s=rates.tokens_per_s,
            tflops_per_gpu=rates.tflops_per_gpu,
            mfu=rates.mfu,
            mem_allocated_gib=memory_allocated_gib(self.groups.device),
            moe=metrics.get("moe"),
        )
        self.writer.write_train(row, step_time_s=step_time_s)  # the console line: its interval's means
        self.logger.log_metrics(logged_metrics(row.as_dict()), step=iteration)
        if trainer.timers is not None and not trainer.timers.empty and iteration % self.cfg.train.log_interval == 0:
            times = trainer.timers.report(normalizer=self.cfg.train.log_interval, wait=False)
            self.log(f"{self.writer.iteration_prefix(iteration)} | {times}")

    def finish(self, built, *, iteration: int, stopped: Optional[str]) -> dict:
        """Write layout.json (collective gather) and return the job summary (JobResult fields)."""
        gather_and_write_layout(self.run_dir, self.rank_facts(built), rank=self.groups.rank,
                                world_size=self.groups.world_size)  # collective
        if stopped is not None:
            self.log(f"stopped after iteration {iteration} ({stopped}); checkpoint saved" if built.cfg.checkpoint.save
                     else f"stopped after iteration {iteration} ({stopped})")
        mean_tps = sum(self.tokens_per_s) / len(self.tokens_per_s) if self.tokens_per_s else None
        peak = _max_over_ranks(peak_memory_gib(self.groups.device), self.groups.device)  # collective
        if peak is not None:
            self.log(f"peak memory allocated: {peak:.2f} GiB (max over ranks)")
        mfu = None
        if mean_tps is not None:
            mfu = self.rates(self.cfg.train.global_batch_size * self.cfg.model.seq_length / mean_tps).mfu
        result = JobResult(
            layout=dataclasses.asdict(self.derived),
            tokens_per_s_per_gpu=None if mean_tps is None else mean_tps / self.groups.world_size,
            mfu=mfu,
            peak_memory_gib=peak,
            final_loss=self.last_loss,
            run_dir=str(self.run_dir),
            **(eval_summary(read_metrics(self.run_dir)) if self.is_writer else {}),
        )
        return dataclasses.asdict(result)

    def rank_facts(self, built) -> RankFacts:
        """This rank's layout.json entry from the objects that ran (DESIGN.md §2)."""
        g, counters = self.groups, self.counters
        num_params = 0
        for chunk in built.chunks:
            for name, param in chunk.module.named_parameters():
                spec = chunk.specs[name]
                if spec.counts_on(g.tp_rank):  # TP-replicated params once per TP group, the tied copy never
                    rows = spec.valid if spec.valid is not None and spec.partition_dim is not None else None
                    num_params += param.numel() if rows is None else param.numel() // param.shape[spec.partition_dim] * rows
        stats = built.trainer.stats
        counters.note_inflight(stats.max_inflight_microbatches)
        if stats.calls:
            counters.bytes_sent["pp"] = stats.bytes_sent.get("pp", 0) * counters.iterations // stats.calls
        for kind, nbytes in _collective_bytes(built, counters).items():
            counters.bytes_sent[kind] = nbytes
        counters.samples_read = built.provider.samples_read
        pieces = built.trainer.optimizer.sharded_state_dict().params  # the wrapper's own listing of its state
        # fp32 main params that are tensors of their own (ZeRO-2 / ZeRO-3's alias FSDP's fp32 shards)
        copies = [p.main for p in pieces if p.main is not None and not aliases_param(p.main, p.param)]
        # FSDP chunks hold fp32 shards and compute in their compute dtype (bf16 / fp16: the shards are the masters)
        param_dtype = getattr(built.chunks[0], "compute_dtype", None) or next(built.chunks[0].module.parameters()).dtype
        has_copy = bool(copies) or param_dtype != torch.float32
        state_bytes = tensor_bytes([p.state for p in pieces]) + tensor_bytes(copies)
        held = held_bytes(built.chunks, built.trainer.optimizer)
        return RankFacts.build(
            g,
            data_parallel_sharding_strategy=running_strategy(built.cfg, g.dp_cp_size),
            param_bytes=held.params,
            grad_bytes=held.grads,
            layers=[n for c in built.chunks for n in unwrap(c).layer_numbers],
            num_params=num_params,
            param_dtype=param_dtype,
            main_param_dtype=torch.float32 if has_copy else None,
            optimizer_state_bytes=state_bytes,
            schedule=self.derived.schedule,
            counters=counters,
        )

    def close(self) -> None:
        try:
            self.logger.finish()  # before the writer closes: a logger's own warnings still reach train.log
        finally:
            if self.writer is not None:
                self.writer.close()


def _max_over_ranks(value: Optional[float], device) -> Optional[float]:
    """Max of a per-rank number over the default group (None everywhere when None on rank 0's device kind)."""
    if value is None:
        return None
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _ring_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `nbytes` over `group_size` ranks: 2·(n−1)/n·size."""
    return 0 if group_size <= 1 else 2 * (group_size - 1) * nbytes // group_size


def _collective_bytes(built, counters: IterationCounters) -> dict:
    """Bytes this rank sent over TP, DP and the embedding group in the ``counters.iterations`` iterations
    (``counters.microbatches`` micro-batches: a batch-size ramp or step schedule varies them per iteration).

    Derived from the sizes of the collectives an iteration issues (ring algorithm, as NCCL's), not
    counted on the wire: DP = the grad buffers (all-reduce, or reduce-scatter + all-gather with
    ZeRO-1: the same volume), or ZeRO-2 / ZeRO-3's gathers and reduce-scatters
    (`FullyShardedDataParallel.dp_bytes_sent`); embedding = the tied word-embedding grad; TP = per layer and
    micro-batch two all-reduces of [s, b, h] forward and two backward (Megatron §3; with sequence
    parallelism all-gather + reduce-scatter, the same volume), plus the embedding's forward one.
    """
    g, cfg = built.groups, built.cfg
    per_iteration = {"dp": 0, "embedding": 0}
    dp_per_microbatch = 0
    for chunk in built.chunks:
        for buf in chunk.grad_buffers:
            per_iteration["dp"] += _ring_bytes(buf.numel * buf.dtype.itemsize, g.dp_cp_size)
        if hasattr(chunk, "dp_bytes_sent"):  # ZeRO-2 / ZeRO-3: FSDP's gathers and reduce-scatters
            per_mb, per_it = chunk.dp_bytes_sent()
            dp_per_microbatch += per_mb
            per_iteration["dp"] += per_it
        for name, spec in chunk.specs.items():
            if spec.tied_embedding and g.pp_size > 1:
                param = dict(chunk.module.named_parameters())[name]
                # (under ZeRO-2 / ZeRO-3 the grad's local shard)
                per_iteration["embedding"] += _ring_bytes(local_shard(param)[0].numel() * 4, 2)
    act_bytes = cfg.model.seq_length * cfg.train.micro_batch_size * cfg.model.hidden_size * built.trainer.dtype.itemsize
    layers = sum(len(unwrap(c).layer_numbers) for c in built.chunks)
    per_mb = 4 * layers + (1 if g.is_first_stage else 0)
    out = {"tp": _ring_bytes(act_bytes, g.tp_size) * per_mb * counters.microbatches,
           **{kind: nbytes * counters.iterations for kind, nbytes in per_iteration.items()}}
    out["dp"] += dp_per_microbatch * counters.microbatches
    return out

