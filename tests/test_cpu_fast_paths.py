"""The CPU-step fast paths (bench/reports/2026-12-01-cpu-speed.md) compute bit for bit what the paths they
replaced did.

Each reference below is the replaced code, written out: the tests assert ``torch.equal`` (not a
tolerance), since the fast paths only drop copies and passes, never reorder a floating-point sum.
"""

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from mptrain.groups import build_groups
from mptrain.layers.cross_entropy import vocab_parallel_cross_entropy


def _replaced_cross_entropy(logits, target, grad_loss, vocab_size, smoothing, group=None):
    """The vocab-parallel cross entropy before the fast path: a masked fp32 copy of the logits, its
    max, an in-place shift, exp into a second tensor, Σ exp, softmax in place; backward from it.
    Returns (loss, grad of the logits) for the upstream ``grad_loss``."""
    tp = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    n = logits.shape[-1]
    start = rank * n
    padded = torch.arange(start, start + n) >= vocab_size
    x = logits.float()
    x = x.masked_fill(padded, float("-inf")) if start + n > vocab_size else x.clone()
    x_max = x.amax(dim=-1)
    if tp > 1:
        dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=group)
    x.sub_(x_max.unsqueeze(-1))
    in_range = (target >= start) & (target < start + n)
    local_t = (target - start).masked_fill(~in_range, 0)
    target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
    exp_x = x.exp()
    stats = [target_logit, exp_x.sum(dim=-1)]
    if smoothing > 0:
        stats.append(x.masked_fill(padded, 0.0).sum(dim=-1))
    stacked = torch.stack(stats, dim=-1)
    if tp > 1:
        dist.all_reduce(stacked, group=group)
    log_z = stacked[..., 1].log()
    alpha = smoothing * vocab_size / (vocab_size - 1) if smoothing > 0 else 0.0
    loss = log_z - stacked[..., 0] if smoothing <= 0 else \
        log_z - (1.0 - alpha) * stacked[..., 0] - alpha * (stacked[..., 2] / vocab_size)
    grad = exp_x.div_(stacked[..., 1].unsqueeze(-1))
    grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - alpha) * in_range.to(grad.dtype).unsqueeze(-1))
    if alpha > 0:
        grad.sub_((alpha / vocab_size) * (~padded).to(grad.dtype))
    grad.mul_(grad_loss.unsqueeze(-1))
    return loss, grad.to(logits.dtype)


def _fast_cross_entropy(logits, target, grad_loss, vocab_size, smoothing, group=None):
    leaf = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(leaf * 1, target, group=group, vocab_size=vocab_size,
                                        label_smoothing=smoothing)
    loss.backward(grad_loss)
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,padded", [(1000, 1024), (1024, 1024)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_fast_path_is_bit_equal_to_replaced(dtype, vocab, padded, smoothing):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 3, padded, generator=gen) * 3).to(dtype)
    logits[..., vocab:] = 50.0  # padding must be masked out, not just small
    target = torch.randint(0, vocab, (16, 3), generator=gen)
    grad_loss = torch.rand(16, 3, generator=gen)
    want = _replaced_cross_entropy(logits, target, grad_loss, vocab, smoothing)
    got = _fast_cross_entropy(logits, target, grad_loss, vocab, smoothing)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].dtype == dtype and not got[1][..., vocab:].any()  # no grad into the padding


def _ce_tp2(rank, world, vocab):
    g = build_groups(world, 1)
    try:
        gen = torch.Generator().manual_seed(1)
        logits = torch.randn(5, 3, 12, generator=gen) * 3
        logits[..., vocab:] = 50.0
        target = torch.randint(0, vocab, (5, 3), generator=gen)
        grad_loss = torch.rand(5, 3, generator=gen)
        local = logits.chunk(world, -1)[g.tp_rank].contiguous()
        want = _replaced_cross_entropy(local, target, grad_loss, vocab, 0.1, g.tp_group)
        got = _fast_cross_entropy(local, target, grad_loss, vocab, 0.1, g.tp_group)
        return torch.equal(got[0], want[0]), torch.equal(got[1], want[1])
    finally:
        g.destroy()


@pytest.mark.parametrize("vocab", [10, 5])  # 5 of 12: rank 1's shard is padding only (its max is −inf)
def test_cross_entropy_fast_path_bit_equal_at_tp2(vocab):
    assert run_distributed(_ce_tp2, 2, vocab) == [(True, True), (True, True)]
