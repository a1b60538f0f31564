"""``train.defer_step_read`` on CUDA (marker ``gpu``; skipped without CUDA).

The whole trainer, bf16 with the chunk graph and CUDA graphs (``compile_mode=auto``), a non-finite
grad injected at iteration 3: the deferred read (pinned host copies, settled one iteration late)
writes the same rows as the read at each step's end: the skip, the LR schedule waiting over it, the
counters and the train / valid order exactly; losses and grad norms to the run-to-run noise of
CUDA's non-deterministic backward kernels (attention, embedding). The CPU counterpart, bitwise, is
tests/test_deferred_step.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from train_utils import compose

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMMON = ["model=tiny", "model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
          "model.seq_length=64", "precision=bf16", "model.compile_layers=true", "train.global_batch_size=8",
          "train.micro_batch_size=4", "train.train_iters=8", "train.eval_interval=4", "train.eval_iters=1",
          "optim.lr_warmup_iters=4", "optim.lr_decay_style=cosine", "optim.lr_decay_iters=8",
          "debug.nonfinite_grad_rank=0", "debug.nonfinite_grad_iteration=3", "run.progress_bar=false"]
EXACT = ("split", "iteration", "lr", "skipped_iter", "skipped_iters_total", "nan_iters_total", "consumed_samples")


def _rows(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_deferred_read_on_cuda_writes_the_same_rows(tmp_path):
    import torch.distributed as dist

    from mptrain.training.run import run

    runs = {}
    for defer in ("true", "false"):
        run_dir = tmp_path / defer
        run(compose(COMMON + [f"train.defer_step_read={defer}", f"run.dir={run_dir}"]))
        if dist.is_initialized():
            dist.destroy_process_group()
        runs[defer] = _rows(run_dir)
    got, want = runs["true"], runs["false"]
    assert [{k: r.get(k) for k in EXACT} for r in got] == [{k: r.get(k) for k in EXACT} for r in want]
    train = {r["iteration"]: r for r in got if r["split"] == "train"}
    assert [train[i]["skipped_iter"] for i in range(1, 9)] == [False, False, True] + [False] * 5
    assert train[4]["lr"] == train[3]["lr"] != train[2]["lr"]
    for a, b in zip(got, want):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-3 * abs(b["lm_loss"]), (a, b)
        if b.get("grad_norm") is not None:
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-2 * abs(b["grad_norm"]), (a, b)
    log = (tmp_path / "true" / "train.log").read_text()
    assert "compile=chunk" in log, log
