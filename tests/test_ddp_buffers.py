"""GradBuffer layout (pure) and DDP accumulation / no_sync / overlap launch timing (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from mptrain.distributed import DistributedDataParallel, GradBuffer, default_bucket_size
from mptrain.groups import build_groups


def _named(*sizes):
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_layout_reverse_order_buckets_and_own_bucket():
    named = _named(5, 7, 3, 4, 6)  # registration order p0..p4
    buf = GradBuffer(named, dtype=torch.float32, bucket_size=8, dp_size=1, pad_for_dp=False,
                     own_bucket=frozenset({"p2"}))
    # reverse order: p4(6) p3(4) -> closes at 10 >= 8; p2 alone; p1(7) p0(5) -> 12
    assert [b.param_names for b in buf.buckets] == [("p4", "p3"), ("p2",), ("p1", "p0")]
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 10), (10, 13), (13, 25)]
    assert buf.slot(named[4][1]).start == 0 and buf.slot(named[0][1]).end == 25
    assert buf.numel == 25


def test_layout_padded_for_dp():
    named = _named(5, 7, 3)
    buf = GradBuffer(named, dtype=torch.float32, bucket_size=100, dp_size=4, pad_for_dp=True,
                     own_bucket=frozenset({"p1"}))
    # p2(3) then p1 alone -> [0,3) padded to 4; p1 [4,11) padded to 12; p0 [12,17) padded to 20
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 4), (4, 12), (12, 20)]
    assert buf.buckets[1].shard_range(1, 4) == (6, 8)
    assert buf.data.numel() == 20


def test_main_grad_is_a_view_and_default_size():
    named = _named(6, 4)
    buf = GradBuffer(named, dtype=torch.bfloat16, bucket_size=None, dp_size=2, pad_for_dp=False)
    g = buf.main_grad(named[0][1])
    g.fill_(2.0)
    assert buf.data[4:10].eq(2.0).all() and buf.data[:4].eq(0).all()  # p0 sits after p1
    assert g.dtype == torch.bfloat16
    assert default_bucket_size(8) == 40_000_000 and default_bucket_size(64) == 64_000_000
    with pytest.raises(ValueError, match="bucket_size=0"):
        GradBuffer(named, dtype=torch.float32, bucket_size=0, dp_size=1, pad_for_dp=False)


class _Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 6).to(dtype)
        self.b = torch.nn.Linear(6, 3).to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _no_sync_and_overlap(rank, world, overlap):
    groups = build_groups(1, 1)
    try:
        net = _Net()
        ddp = DistributedDataParallel(net, groups, grad_reduce_in_fp32=False, overlap_grad_reduce=overlap,
                                      bucket_size=20, use_distributed_optimizer=False)
        n_buckets = len(ddp.grad_buffers[0].buckets)
        xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + m)) for m in range(3)]
        with ddp.no_sync():
            for x in xs[:2]:
                ddp(x).square().sum().backward()
        launched_after_no_sync = ddp.launched_buckets()
        local_two = ddp.grad_buffers[0].data.clone()
        ddp(xs[2]).square().sum().backward()
        launched_in_backward = ddp.launched_buckets()
        assert all(p.grad is None for p in net.parameters())  # hooks moved grads into the buffer
        if not overlap:
            local_all = ddp.grad_buffers[0].data.clone()
        ddp.finish_grad_sync()
        synced = ddp.grad_buffers[0].data.clone()
        # reference: the same three micro-batches with plain autograd, summed over ranks by hand
        ref = _Net()
        for x in xs:
            ref(x).square().sum().backward()
        expected = torch.cat([ref.b.bias.grad, ref.b.weight.grad.reshape(-1), ref.a.bias.grad, ref.a.weight.grad.reshape(-1)])
        dist.all_reduce(expected)
        out = {"n_buckets": n_buckets, "after_no_sync": launched_after_no_sync, "in_backward": launched_in_backward,
               "local_two": local_two, "synced": synced, "expected": expected}
        if not overlap:
            out["local_all"] = local_all
        return out
    finally:
        groups.destroy()


@pytest.mark.parametrize("overlap", [False, True])
def test_sync_only_after_last_microbatch(overlap):
    r0, r1 = run_distributed(_no_sync_and_overlap, 2, overlap)
    n = r0["n_buckets"]
    assert n == 2  # b (3 + 18 = 21 >= 20 closes bucket 0), then a (6 + 36): the test needs several buckets
    for r in (r0, r1):
        assert r["after_no_sync"] == []  # nothing reduced under no_sync
        # overlap: every bucket launched from the hooks of the last backward; otherwise none yet
        assert r["in_backward"] == ([(0, b) for b in range(n)] if overlap else [])
    assert not torch.equal(r0["local_two"], r1["local_two"])  # local accumulations differ per rank
    if not overlap:
        assert torch.equal(r0["synced"], r0["local_all"] + r1["local_all"])  # a SUM over DP, exact for 2 terms
    assert torch.equal(r0["synced"], r1["synced"])
    # accumulate-in-buffer vs autograd accumulation: same adds in the same order per rank; the
    # DP sum of two terms is exact either way, so only the micro-batch accumulation could differ.
    torch.testing.assert_close(r0["synced"], r0["expected"], rtol=1e-6, atol=1e-6)


def _fp32_reduce(rank, world):
    groups = build_groups(1, 1)
    try:
        net = _Net(torch.bfloat16)
        ddp = DistributedDataParallel(net, groups, grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                      bucket_size=None, use_distributed_optimizer=False)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)).bfloat16()
        ddp(x).float().square().sum().backward()
        ddp.finish_grad_sync()
        g = ddp.main_grad(net.a.weight)
        ddp.scale_gradients(0.5)
        return [b.dtype for b in ddp.grad_buffers], g.dtype, len(ddp.grad_buffers[0].buckets), ddp.main_grad(net.a.weight).clone(), g.clone()
    finally:
        groups.destroy()


def test_grad_reduce_in_fp32_buffer_dtype():
    (d0, gd, nb, g_after, g_view), _ = run_distributed(_fp32_reduce, 2)
    assert d0 == [torch.float32] and gd == torch.float32
    assert nb == 1  # default bucket size (40M elements) holds the whole toy model
    assert torch.equal(g_after, g_view)  # main_grad returns a live view of the buffer
