"""Issue 20 round 2: host-overhead cuts that must not change a number (single process, CPU)."""

import types

import pytest
import torch

from harness import run_distributed
from mptrain.config.optim import OptimConfig
from mptrain.distributed import DistributedDataParallel
from mptrain.groups import build_groups
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import build_optimizer_factory
from mptrain.precision import FP32Optimizer, MixedPrecisionOptimizer
from mptrain.training.step import _takes_keyword
from train_utils import count_host_reads

SOLO = types.SimpleNamespace(mp_group=None, tp_rank=0, device=torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_step_reads_the_loss_along_in_its_one_host_read(dtype, monkeypatch):
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
    result = opt.step(read_along=totals)
    assert calls == {"tolist": 1, "item": 0}  # one host read for the norm, the skip decision and the loss
    assert result.update_successful and result.read_along == (1234.5678901, 768.0)
    assert _takes_keyword(opt.step, "read_along") and not _takes_keyword(lambda grad_scale=None: None, "read_along")


def _deferred_adds(rank, world):
    groups = build_groups(1, 1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        ref.load_state_dict(net.state_dict())
        ddp = DistributedDataParallel(net, groups, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      bucket_size=None, use_distributed_optimizer=False)
        seen = []
        original = torch._foreach_add_

        def counted(views, grads, *a, **k):
            seen.append(tuple(tuple(v.shape) for v in views))
            return original(views, grads, *a, **k)

        torch._foreach_add_ = counted
        try:
            for m in range(3):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(m))
                ddp(x).square().sum().backward()
                ref(x).square().sum().backward()
        finally:
            torch._foreach_add_ = original
        ddp.finish_grad_sync()
        same = all(torch.equal(ddp.main_grad(p), r.grad) for p, r in zip(net.parameters(), ref.parameters()))
        return seen, same, [p.grad is None for p in net.parameters()]
    finally:
        groups.destroy()


def test_bias_grads_are_added_by_one_foreach_add_per_backward():
    (seen, same, dropped), = run_distributed(_deferred_adds, 1)
    assert seen == [((3,), (5,))] * 3  # both biases, in one launch, at the end of each backward
    assert same  # bit-equal to autograd's own accumulation over the 3 micro-batches
    assert all(dropped)
