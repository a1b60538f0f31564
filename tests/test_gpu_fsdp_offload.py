"""ZeRO-3 with ``optim.optimizer_cpu_offload`` on CUDA (marker ``gpu``; skipped without CUDA).

The whole trainer, bf16, compiled (the default on CUDA), two micro-batches a step, one GPU: FSDP2 keeps the one
rank's fp32 shards in pinned host memory, the grads accumulate unsharded on the device and reduce once a step,
and each layer is its own graph and FSDP unit (`mptrain.distributed.fsdp`). It trains the losses of the same job
without offload (no_shard at dp 1, the chunk graph with CUDA graphs) to bf16 noise; the start-up log names the
per-layer graphs and reports the device memory of the build. The CPU counterpart, exact, is tests/test_fsdp.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from train_utils import compose

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMMON = ["model=tiny", "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
          "model.seq_length=64", "precision=bf16", "train.global_batch_size=8", "train.micro_batch_size=4",
          "train.train_iters=4", "train.eval_interval=null", "run.progress_bar=false",
          "parallel.data_parallel_sharding_strategy=optim_grads_params"]


def test_offloaded_zero3_trains_the_losses_of_the_run_without_offload(tmp_path):
    import torch.distributed as dist

    from mptrain.training.run import run

    rows = {}
    for name, extra in (("offload", ["optim.optimizer_cpu_offload=true"]), ("device", [])):
        run(compose(COMMON + extra + [f"run.dir={tmp_path / name}"]))
        if dist.is_initialized():
            dist.destroy_process_group()
        rows[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows["offload"]] == [r["iteration"] for r in rows["device"]] == [1, 2, 3, 4]
    for a, b in zip(rows["offload"], rows["device"]):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-2 * abs(b["lm_loss"]), (a, b)
    log = (tmp_path / "offload" / "train.log").read_text()
    assert "compile=layer (chunk graph: ZeRO-2 / ZeRO-3: FSDP2 gathers each layer's params around" in log, log
    assert "(ZeRO-3, FSDP2, dp=1, CPU offload)" in log, log
    built = re.search(r"are built: allocated ([\d.]+) GiB, max allocated ([\d.]+) GiB \(rank 0\)", log)
    assert built is not None and float(built[1]) <= float(built[2]), log
    assert "compile=chunk" in (tmp_path / "device" / "train.log").read_text()
