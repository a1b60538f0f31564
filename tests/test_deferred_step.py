"""The deferred step read (``train.defer_step_read``) changes when the host reads a step's
statistics, never what the step does.

- the optimizer: a step makes no host read; the trainer's `StepRead` reads the loss and the step's
  statistics in one copy; a skipped step leaves params, main params, moments and step counts
  bitwise as they were, and the steps after it equal a run that never saw it;
- the trainer: metrics.jsonl (train and evaluation rows, their order), the LR schedule around a
  skipped step and the skip counters are the same with the read deferred and not, at tp1pp1 and at
  pp2 x dp2 with ZeRO-1; a step that raises still leaves the rows of the iterations before it.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from harness import run_distributed
from mptrain.config.optim import OptimConfig
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import build_optimizer_factory
from mptrain.precision import FP32Optimizer, MixedPrecisionOptimizer
from mptrain.precision.optimizer import TooManySkippedStepsError
from mptrain.training.step import StepRead
from train_utils import compose, count_host_reads, read_rows, run_job

SOLO = types.SimpleNamespace(mp_group=None, tp_rank=0, device=torch.device("cpu"))


def _optimizer(cls, dtype, *, max_consecutive_skips=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(dtype)),
              torch.nn.Parameter(torch.randn(4, generator=gen).to(dtype))]
    specs = [ShardSpec((4, 3)), ShardSpec((4,), no_weight_decay=True)]
    opt = cls(build_optimizer_factory(OptimConfig(name="adamw", lr=0.01, weight_decay=0.1)), params, specs,
              lambda p: p.grad, SOLO, scaler=None, clip_grad=1.0, max_consecutive_skips=max_consecutive_skips)
    assert opt.folded_step  # fused AdamW, no scaler: the step whose skip decision stays on the device
    return opt, params


def _grads(params, seed, poison=False):
    gen = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    if poison:
        params[1].grad[2] = float("inf")


def _state(opt, params) -> list:
    """Every number the step may touch: model params, main params, Adam moments and step counts."""
    out = [p.detach().clone() for p in params] + [e.main.detach().clone() for e in opt.entries]
    for e in opt.entries:
        st = opt.optimizer.state.get(e.main, {})
        out += [st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq", "step") if k in st]
    return out


@pytest.mark.parametrize("cls,dtype", [(FP32Optimizer, torch.float32), (MixedPrecisionOptimizer, torch.bfloat16)])
def test_launched_skip_changes_nothing_and_later_steps_match(cls, dtype, monkeypatch):
    opt, params = _optimizer(cls, dtype)
    ref, ref_params = _optimizer(cls, dtype)  # the same steps, never shown the poisoned one
    _grads(params, 0), _grads(ref_params, 0)
    assert opt.step().result().update_successful and ref.step().result().update_successful
    before = _state(opt, params)

    _grads(params, 1, poison=True)
    totals = torch.tensor([12.5, 4.0], dtype=torch.float64)
    calls = count_host_reads(monkeypatch)
    stats = opt.step()
    read = StepRead(totals, stats)  # the trainer's buffer: its loss totals and the step's statistics
    assert calls == {"tolist": 0, "item": 0}  # launched without a host read
    loss_sum, tokens, *values = read.values()
    result = stats.settle(values)
    assert calls == {"tolist": 1, "item": 0}  # one read: norm, skip flag, the loss totals
    assert not result.update_successful and result.grad_norm is None and (loss_sum, tokens) == (12.5, 4.0)
    assert stats.result() is result and calls["tolist"] == 1  # settled once
    assert opt.skipped_iters_total == 1 and opt.nan_iters_total == 1 and opt.consecutive_skips == 1
    after = _state(opt, params)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))

    for seed in (2, 3):
        _grads(params, seed), _grads(ref_params, seed)
        got, want = opt.step().result(), ref.step().result()
        assert got.update_successful and got.grad_norm == want.grad_norm
    assert opt.consecutive_skips == 0
    assert all(torch.equal(a, b) for a, b in zip(_state(opt, params), _state(ref, ref_params)))


def test_skip_limit_raises_when_the_step_is_settled():
    opt, params = _optimizer(FP32Optimizer, torch.float32, max_consecutive_skips=1)
    _grads(params, 0, poison=True)
    assert not opt.step().result().update_successful  # 1 skip: within the limit
    _grads(params, 1, poison=True)
    stats = opt.step()  # the step never raises: the decision is on the device
    with pytest.raises(TooManySkippedStepsError, match="2 consecutive steps"):
        stats.result()


SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.global_batch_size=8",
         "train.micro_batch_size=2", "train.train_iters=5", "train.eval_interval=3", "train.eval_iters=1",
         "optim.lr_warmup_iters=3", "optim.lr_decay_style=cosine", "optim.lr_decay_iters=5", "debug.nonfinite_grad_iteration=3"]
LAYOUTS = {
    "tp1pp1-bf16": (1, ["parallel=tp1pp1", "precision=bf16", "debug.nonfinite_grad_rank=0"]),
    "pp2-dp2-zero1": (4, ["parallel=tp1pp2", "parallel.use_distributed_optimizer=true",
                          "debug.nonfinite_grad_rank=1"]),
}
KEYS = ("split", "iteration", "lm_loss", "grad_norm", "lr", "loss_scale", "skipped_iter", "skipped_iters_total",
        "nan_iters_total", "consumed_samples")


def _all_rows(run_dir) -> list:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in KEYS} for r in rows]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_deferred_read_writes_the_same_rows(tmp_path, layout):
    world, extra = LAYOUTS[layout]
    runs = {}
    for defer in ("true", "false"):
        run_dir = tmp_path / defer
        run_distributed(run_job, world, SMALL + extra + [f"train.defer_step_read={defer}", f"run.dir={run_dir}"])
        runs[defer] = _all_rows(run_dir)
    assert runs["true"] == runs["false"]  # every value, and the order of train / valid rows
    train = {r["iteration"]: r for r in runs["true"] if r["split"] == "train"}
    assert sorted(train) == list(range(1, 6))
    assert [train[i]["skipped_iter"] for i in range(1, 6)] == [False, False, True, False, False]
    assert train[4]["lr"] == train[3]["lr"] != train[2]["lr"]  # the schedule waited over the skipped step
    assert train[5]["skipped_iters_total"] == 1 and train[3]["grad_norm"] is None
    assert [(r["split"], r["iteration"]) for r in runs["true"]][:5] == [
        ("valid", 0), ("train", 1), ("train", 2), ("train", 3), ("valid", 3)]


def test_a_step_that_raises_leaves_the_rows_before_it(tmp_path):
    from mptrain.training.run import run

    run_dir = tmp_path / "r"
    cfg = compose(["model=tiny", "train.train_iters=5", "train.eval_interval=null", f"run.dir={run_dir}",
                   "debug.fail_rank=0", "debug.fail_iteration=3", "train.defer_step_read=true"])
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at iteration 3"):
        run(cfg)
    assert [r["iteration"] for r in read_rows(run_dir)] == [1, 2]  # iteration 2 was settled on the way out
