"""Host-overhead cuts that must not change a number (single process, CPU)."""

import types

import pytest
import torch

from harness import run_distributed
from mptrain.config.optim import OptimConfig
from mptrain.distributed import DistributedDataParallel
from mptrain.distributed.accumulate import StagedAdd
from mptrain.groups import build_groups
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import build_optimizer_factory
from mptrain.precision import FP32Optimizer, MixedPrecisionOptimizer
from mptrain.training.step import StepRead
from train_utils import count_host_reads

SOLO = types.SimpleNamespace(mp_group=None, tp_rank=0, device=torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_step_and_the_loss_are_read_in_one_host_read(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(dtype)),
              torch.nn.Parameter(torch.randn(4, generator=gen).to(dtype))]
    specs = [ShardSpec((4, 3)), ShardSpec((4,), no_weight_decay=True)]
    cls = FP32Optimizer if dtype == torch.float32 else MixedPrecisionOptimizer
    opt = cls(build_optimizer_factory(OptimConfig(name="adamw", lr=0.01, weight_decay=0.1)), params, specs,
              lambda p: p.grad, SOLO, scaler=None, clip_grad=1.0, max_consecutive_skips=0)
    assert opt.folded_step
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    totals = torch.tensor([1234.5678901, 768.0], dtype=torch.float64)  # the trainer's [Σ loss_sum, Σ tokens]
    calls = count_host_reads(monkeypatch)
    stats = opt.step()
    loss_sum, tokens, *values = StepRead(totals, stats).values()
    result = stats.settle(values)
    assert calls == {"tolist": 1, "item": 0}  # one host read for the norm, the skip decision and the loss
    assert result.update_successful and (loss_sum, tokens) == (1234.5678901, 768.0)


def _counting(name: str, seen: list):
    """Patch ``torch.<name>`` to record the shapes of its first list argument; returns the undo."""
    original = getattr(torch, name)

    def counted(tensors, *a, **k):
        seen.append((name, tuple(tuple(t.shape) for t in tensors)))
        return original(tensors, *a, **k)

    setattr(torch, name, counted)
    return lambda: setattr(torch, name, original)


def _deferred_adds(rank, world, dtype):
    groups = build_groups(1, 1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)
        ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)
        ref.load_state_dict(net.state_dict())
        ddp = DistributedDataParallel(net, groups, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      bucket_size=None, use_distributed_optimizer=False)
        seen = []
        undo = [_counting("_foreach_add_", seen), _counting("_foreach_copy_", seen)]
        expected = [torch.zeros(p.shape) for p in ref.parameters()]
        try:
            for m in range(3):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(m)).to(dtype)
                ddp(x).float().square().sum().backward()
                ref(x).float().square().sum().backward()
                for e, r in zip(expected, ref.parameters()):  # each micro-batch's grad added in fp32
                    e.add_(r.grad)
                    r.grad = None
        finally:
            for u in undo:
                u()
        ddp.finish_grad_sync()
        same = all(torch.equal(ddp.main_grad(p), e) for p, e in zip(net.parameters(), expected))
        return seen, same, [p.grad is None for p in net.parameters()]
    finally:
        groups.destroy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_grads_are_added_by_one_foreach_add_per_backward(dtype):
    (seen, same, dropped), = run_distributed(_deferred_adds, 1, dtype)
    adds = [("_foreach_add_", ((3,), (5,)))]  # both biases, in one launch, at the end of each backward
    if dtype == torch.bfloat16:  # cast into the fp32 staging by one multi-tensor copy first
        adds = [("_foreach_copy_", ((3,), (5,)))] + adds
    assert seen == adds * 3
    assert same  # bit-equal to the fp32 sum of the 3 micro-batches' grads
    assert all(dropped)


def test_staged_add_flushes_exactly_what_is_queued():
    gen = torch.Generator().manual_seed(4)
    flat = torch.randn(12, generator=gen)
    views = [flat[0:3], flat[3:8].view(5), flat[8:12]]
    keys = ["a", "b", "c"]
    staged = StagedAdd({k: v.numel() for k, v in zip(keys, views)}, dtype=torch.float32, device=torch.device("cpu"))
    reference = flat.clone()
    for rnd in range(2):
        grads = [torch.randn(v.shape, generator=gen).to(torch.bfloat16) for v in views]
        picks = [0, 2] if rnd == 0 else [1, 2]  # a partial queue, then another: staging slots are per key
        for i in picks:
            staged.queue(keys[i], views[i], grads[i])
            reference[sum(v.numel() for v in views[:i]):][:views[i].numel()].add_(grads[i])
        assert len(staged) == 2
        staged.flush()
        assert len(staged) == 0 and torch.equal(flat, reference)
    staged.queue("a", views[0], torch.ones(3))  # same dtype: straight into the views
    staged.flush()
    reference[0:3] += 1
    assert torch.equal(flat, reference)


def test_staged_add_adds_a_key_queued_twice_at_once():
    flat = torch.zeros(4)
    staged = StagedAdd({"a": 2, "b": 2}, dtype=torch.float32, device=torch.device("cpu"))
    first, second = torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([10.0, 20.0], dtype=torch.bfloat16)
    staged.queue("a", flat[0:2], first)
    staged.queue("a", flat[0:2], second)  # its one staging slot holds the first: the second goes in at once
    staged.queue("b", flat[2:4], second)
    assert len(staged) == 2 and flat.tolist() == [10.0, 20.0, 0.0, 0.0]
    staged.flush()
    assert flat.tolist() == [11.0, 22.0, 10.0, 20.0]
