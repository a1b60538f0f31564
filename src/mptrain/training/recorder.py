"""The run's record: run folder, metrics.jsonl rows, throughput, layout.json, the job summary.

Glue between the loop (`mptrain.training.run`) and the writers that own each file
(`rundir`, `metrics`, `layout`, `throughput`, `sweep`). Only rank 0 writes; every rank calls the
same methods, and the collective ones (opening the run folder, gathering layout.json) are marked.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

from mptrain.training.metrics import EvalRow, MetricsWriter, TrainRow
from mptrain.training.rundir import resolve_run_dir
from mptrain.training.sweep import JobResult, current_sweep_job

log = logging.getLogger("mptrain")


def checkpoint_exists(load_dir: Optional[str]) -> bool:
    """Whether `checkpoint.load` points at a folder with a `latest` checkpoint (the run then resumes)."""
    return bool(load_dir) and (Path(load_dir) / "latest").exists()


@dataclasses.dataclass
class Recorder:
    cfg: Any
    groups: Any
    derived: Any
    run_dir: Path
    throughput: Throughput
    t_start: float
    writer: Optional[MetricsWriter] = None
    pending: list = dataclasses.field(default_factory=list)
    last_loss: Optional[float] = None
    t_first_step: Optional[float] = None
    tokens_per_s: list = dataclasses.field(default_factory=list)

    @classmethod
    def open(cls, cfg, groups, derived, *, vocab_size: int, t_start: float) -> "Recorder":
        """Resolve and create the run folder (collective), write config.yaml (rank 0)."""
        run_dir = resolve_run_dir(
            cfg,
            rank=groups.rank,
            world_size=groups.world_size,
            resuming=checkpoint_exists(cfg.checkpoint.load),
            sweep_job=current_sweep_job(),
        )
        throughput = _Throughput(cfg, vocab_size=vocab_size, world_size=groups.world_size)
        return cls(cfg=cfg, groups=groups, derived=derived, run_dir=run_dir, throughput=throughput, t_start=t_start)

    @property
    def is_writer(self) -> bool:
        return self.groups.rank == 0

    def log(self, text: str) -> None:
        """A line for the console and train.log (rank 0; held until the writer opens)."""
        if not self.is_writer:
            return
        if self.writer is None:
            self.pending.append(text)
        else:
            self.writer.message(text)

    def start(self, start_iteration: int) -> None:
        """Open metrics.jsonl / train.log (after a checkpoint load decided the start iteration)."""
        self.writer = MetricsWriter(
            self.run_dir,
            self.groups.rank,
            log_interval=self.cfg.train.log_interval,
            train_iters=self.cfg.train.train_iters,
            start_iteration=start_iteration,
        )
        for text in self.pending:
            self.writer.message(text)
        self.pending.clear()
        d = self.derived
        self.log(
            f"job: model={self.cfg.model.name} tp={d.tensor_model_parallel_size} pp={d.pipeline_model_parallel_size} "
            f"vpp={d.virtual_pipeline_model_parallel_size} dp={d.data_parallel_size} schedule={d.schedule} "
            f"precision={self.cfg.precision.name} micro-batches={d.num_microbatches} run.dir={self.run_dir}"
        )
        self.log(f"startup: {time.time() - self.t_start:.1f} s to first iteration's setup")

    def eval_row(self, split: str, iteration: int, loss: float) -> None:
        self.writer.write_eval(EvalRow(split=split, iteration=iteration, lm_loss=loss))

    def train_row(self, iteration: int, consumed: int, metrics: dict, trainer, *, step_time_s: float) -> None:
        if self.t_first_step is None:
            self.t_first_step = time.time()
            self.log(f"startup: {self.t_first_step - self.t_start:.1f} s to the end of the first step")
        rates = self.throughput.rates(step_time_s)
        if iteration > 1:  # the first step carries warm-up costs
            self.tokens_per_s.append(rates["tokens_per_s"])
        optimizer = trainer.optimizer
        self.last_loss = metrics["lm_loss"]
        row = TrainRow(
            iteration=iteration,
            consumed_samples=consumed,
            lm_loss=metrics["lm_loss"],
            lr=metrics["lr"],
            grad_norm=metrics["grad_norm"],
            loss_scale=optimizer.get_loss_scale(),
            skipped_iter=metrics["skipped_iter"],
            skipped_iters_total=optimizer.skipped_iters_total,
            nan_iters_total=optimizer.nan_iters_total,
            num_microbatches=trainer.num_microbatches,
            tokens_per_s=rates["tokens_per_s"],
            tflops_per_gpu=rates["tflops_per_gpu"],
            mfu=rates["mfu"],
            mem_allocated_gib=rates["mem_allocated_gib"],
        )
        self.writer.write_train(row)

    def finish(self, built, *, iteration: int, stopped: Optional[str]) -> dict:
        """Write layout.json (collective gather) and return the job summary (JobResult fields)."""
        _write_layout(self.run_dir, built, iteration=iteration)
        if stopped is not None:
            self.log(f"stopped after iteration {iteration} ({stopped}); checkpoint saved" if built.cfg.checkpoint.save
                     else f"stopped after iteration {iteration} ({stopped})")
        mean_tps = sum(self.tokens_per_s) / len(self.tokens_per_s) if self.tokens_per_s else None
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        result = JobResult(
            layout=dataclasses.asdict(self.derived),
            tokens_per_s_per_gpu=None if mean_tps is None else mean_tps / self.groups.world_size,
            mfu=self.throughput.mfu_of(mean_tps),
            peak_memory_gib=peak,
            final_loss=self.last_loss,
            run_dir=str(self.run_dir),
        )
        return dataclasses.asdict(result)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _Throughput:  # TEMPORARY until training/throughput.py lands
    def __init__(self, cfg, *, vocab_size, world_size):
        m = cfg.model
        div = m.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
        v_pad = -(-vocab_size // div) * div
        L, h, s = m.num_layers, m.hidden_size, m.seq_length
        self.tokens = cfg.train.global_batch_size * s
        n = 12 * L * h * h + v_pad * h
        self.flops = 6 * n * self.tokens + 12 * L * h * s * self.tokens
        self.world_size = world_size

    def rates(self, step_time_s):
        tps = self.tokens / step_time_s
        return {"tokens_per_s": tps, "tflops_per_gpu": self.flops / step_time_s / self.world_size / 1e12,
                "mfu": None, "mem_allocated_gib": None}

    def mfu_of(self, tps):
        return None


def _write_layout(run_dir, built, *, iteration):  # TEMPORARY until training/layout.py lands
    import json
    import torch.distributed as dist
    g = built.groups
    num = 0
    for chunk in built.chunks:
        for name, p in chunk.module.named_parameters():
            spec = chunk.specs[name]
            if not spec.counts_on(g.tp_rank):
                continue
            if spec.valid is not None and spec.partition_dim is not None:
                num += p.numel() // p.shape[spec.partition_dim] * spec.valid
            else:
                num += p.numel()
    from mptrain.training.step import unwrap
    layers = [n for c in built.chunks for n in unwrap(c).layer_numbers]
    entry = {**g.coordinates(), "layers": layers, "num_params": num,
             "param_dtype": str(next(built.chunks[0].module.parameters()).dtype).replace("torch.", ""),
             "schedule": built.cfg.schedule.name}
    out = [None] * g.world_size
    dist.all_gather_object(out, entry)
    if g.rank == 0:
        (Path(run_dir) / "layout.json").write_text(json.dumps({"world_size": g.world_size, "ranks": out}, indent=1))
