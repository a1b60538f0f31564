"""Unit tests of the f/g communication functions and vocab-parallel cross entropy (gloo)."""

import pytest
import torch
import torch.nn.functional as F

from harness import run_distributed
from mptrain.groups import build_groups
from mptrain.layers import mappings as M
from mptrain.layers.cross_entropy import vocab_parallel_cross_entropy


def _mappings(rank, world):
    g = build_groups(world, 1)
    try:
        grp, r = g.tp_group, g.tp_rank
        out = {}
        x = torch.full((4, 2, 3), float(r + 1), requires_grad=True)  # rank r holds r+1
        y = M.reduce_from_tp_region(x, grp)
        y.backward(torch.ones_like(y))
        out["g"] = (float(y[0, 0, 0]), float(x.grad[0, 0, 0]))  # (sum 1..p, identity)
        x.grad = None
        y = M.copy_to_tp_region(x, grp)
        y.backward(torch.ones_like(y))
        out["f"] = (float(y[0, 0, 0]), float(x.grad[0, 0, 0]))  # (identity, p)
        full = torch.arange(4 * 2 * 8, dtype=torch.float32).view(4, 2, 8).requires_grad_(True)
        part = M.scatter_to_tp_region(full, grp)
        out["scatter_last"] = torch.equal(part, full.detach().chunk(world, -1)[r])
        back = M.gather_from_tp_region(part, grp)
        out["gather_last"] = torch.equal(back, full.detach())
        seq = M.scatter_to_sequence_parallel_region(full, grp)
        out["scatter_seq"] = torch.equal(seq, full.detach().chunk(world, 0)[r])
        xs = (torch.ones(2, 2, 3) * (r + 1)).requires_grad_(True)
        gathered = M.gather_from_sequence_parallel_region(xs, grp)  # [2p, 2, 3]
        gathered.backward(torch.ones_like(gathered))
        out["gather_seq"] = ([float(v) for v in gathered[:, 0, 0]], float(xs.grad[0, 0, 0]))  # grad reduce-scattered: p
        xr = torch.ones(4, 2, 3).mul(r + 1).requires_grad_(True)
        red = M.reduce_scatter_to_sequence_parallel_region(xr, grp)
        red.backward(torch.ones_like(red))
        out["reduce_scatter_seq"] = (tuple(red.shape), float(red[0, 0, 0]), float(xr.grad.sum()))
        return out
    finally:
        g.destroy()


def test_mappings_forward_and_backward():
    p = 2
    res = run_distributed(_mappings, p)
    s = float(sum(range(1, p + 1)))
    for r, out in enumerate(res):
        assert out["g"] == (s, 1.0)
        assert out["f"] == (float(r + 1), float(p))
        assert out["scatter_last"] and out["gather_last"] and out["scatter_seq"]
        assert out["gather_seq"] == ([1.0, 1.0, 2.0, 2.0], float(p))
        assert out["reduce_scatter_seq"] == ((2, 2, 3), s, 4 * 2 * 3.0)


def _cross_entropy(rank, world, smoothing, fused=False, inplace=False):
    g = build_groups(world, 1)
    try:
        vocab, padded = 10, 12  # 2 padded entries on the last rank
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(5, 3, padded, generator=gen) * 3
        logits[..., vocab:] = 50.0  # padding must be masked out, not just small
        target = torch.randint(0, vocab, (5, 3), generator=gen)
        ref_logits = logits[..., :vocab].clone().requires_grad_(True)
        # Megatron's smoothing α = ε V/(V-1) equals torch's label_smoothing=α
        ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none",
                              label_smoothing=smoothing * vocab / (vocab - 1)).view(5, 3)
        ref.sum().backward()
        local = logits.chunk(world, -1)[g.tp_rank].clone().requires_grad_(True)
        before = local.detach().clone()
        inner = local * 1.0  # a non-leaf the loss owns (as the model's logits)
        loss = vocab_parallel_cross_entropy(inner, target, group=g.tp_group, vocab_size=vocab, label_smoothing=smoothing,
                                            fused=fused, inplace_backward=inplace)
        loss.sum().backward()
        ref_grad = torch.cat([ref_logits.grad, torch.zeros(5, 3, padded - vocab)], -1).chunk(world, -1)[g.tp_rank]
        assert torch.equal(local.detach(), before)  # the leaf is never written
        # inplace_backward: the grad went over the saved logits; otherwise they are intact
        assert torch.equal(inner.detach(), local.grad) == inplace
        return float((loss - ref).abs().max()), float((local.grad - ref_grad).abs().max())
    finally:
        g.destroy()


# fused: with smoothing and the in-place backward (suite time: each fused case is a compile). Fused without
# either: the model's chunk graph traces it (compared with the plain variant by test_bench_compile's MoE case, tp 1,
# padded vocabulary, and test_grad_accumulation's compiled tp 2 case); its compiled passes in bf16, with the
# logits left intact, are test_fused_cross_entropy_bf16_matches_plain
@pytest.mark.parametrize("smoothing,fused,inplace", [(0.0, False, False), (0.1, False, False), (0.1, True, True)])
def test_vocab_parallel_cross_entropy_matches_torch(smoothing, fused, inplace):
    """Both variants (fused = the compiled three-pass one of model.compile_layers) equal torch's; the
    fused one's inplace_backward writes the grad over its (non-leaf) logits and only then."""
    for loss_err, grad_err in run_distributed(_cross_entropy, 2, smoothing, fused, inplace):
        # fp32; values O(1): differences are reduction-order ulps (~1e-7)
        assert loss_err <= 1e-5 and grad_err <= 1e-6, (loss_err, grad_err)


def _async_vs_plain(rank, world, sequence_parallel, with_bias, compiled):
    """`column_parallel_linear` with the overlapped input-grad collective vs f/ḡ + F.linear."""
    from mptrain.layers.linear import column_parallel_linear

    g = build_groups(world, 1)
    try:
        torch.manual_seed(0)
        s_local = 4 if sequence_parallel else 8
        x0 = torch.randn(world * 4 if not sequence_parallel else 8, 2, 6)  # full [s, b, in], same on all ranks
        x0 = x0.chunk(world, 0)[g.tp_rank] if sequence_parallel else x0
        assert x0.shape[0] == s_local
        torch.manual_seed(1 + g.tp_rank)  # each rank its own shard of the weight
        w0, b0 = torch.randn(5, 6), torch.randn(5)
        dy = torch.randn(8, 2, 5)  # grad of the [s, b, out/tp] output
        grads = {}
        for overlap in (False, True):
            x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
            b = b0.clone().requires_grad_(True) if with_bias else None
            fn = lambda x, w, b: column_parallel_linear(x, w, b, g, sequence_parallel, overlap)  # noqa: E731
            y = (torch.compile(fn) if compiled and overlap else fn)(x, w, b)
            y.backward(dy)
            grads[overlap] = [y.detach(), x.grad, w.grad] + ([b.grad] if with_bias else [])
        return [torch.equal(a, c) if not compiled else torch.allclose(a, c, rtol=1e-5, atol=1e-5)
                for a, c in zip(grads[False], grads[True])]
    finally:
        g.destroy()


@pytest.mark.parametrize("sequence_parallel,with_bias,compiled", [(False, True, False), (True, False, False),
                                                                   (False, True, True), (True, True, True)])
def test_async_grad_allreduce_matches_plain_path(sequence_parallel, with_bias, compiled):
    """parallel.async_tensor_model_parallel_allreduce: same output and grads (bitwise in eager) as
    the f / ḡ + F.linear path, with and without SP, eager and under torch.compile (functional
    collectives)."""
    for rank_result in run_distributed(_async_vs_plain, 2, sequence_parallel, with_bias, compiled):
        assert all(rank_result), rank_result


def _fused_ce_bf16(rank, world):
    """bf16 logits: the fused variant's loss and grad equal the plain variant's (fp32 math inside both); neither
    writes over its (non-leaf) logits without ``inplace_backward``."""
    g = build_groups(world, 1)
    try:
        gen = torch.Generator().manual_seed(3)
        logits = (torch.randn(6, 2, 16, generator=gen) * 4).to(torch.bfloat16).chunk(world, -1)[g.tp_rank]
        target = torch.randint(0, 15, (6, 2), generator=gen)
        out = []
        for fused in (False, True):
            x = logits.clone().requires_grad_(True)
            inner = x * 1  # a non-leaf the loss owns (as the model's logits)
            loss = vocab_parallel_cross_entropy(inner, target, group=g.tp_group, vocab_size=15, fused=fused)
            loss.sum().backward()
            out.append((loss.detach(), x.grad, torch.equal(inner.detach(), logits)))
        (l0, g0, kept0), (l1, g1, kept1) = out
        return float((l0 - l1).abs().max()), float((g0.float() - g1.float()).abs().max()), str(g1.dtype), kept0 and kept1
    finally:
        g.destroy()


def test_fused_cross_entropy_bf16_matches_plain():
    for loss_err, grad_err, dtype, logits_kept in run_distributed(_fused_ce_bf16, 2):
        assert dtype == "torch.bfloat16" and logits_kept
        assert loss_err <= 1e-5 and grad_err <= 2 ** -8, (loss_err, grad_err)  # one bf16 rounding of the grad
