"""Grad norm, clipping and zero counts: hand-computed values, and TP/PP-sharded norms equal to the unsharded one."""

import math

import pytest
import torch

from harness import run_distributed
from mptrain.groups import build_groups
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import build_optimizer_factory
from mptrain.config.optim import OptimConfig
from mptrain.precision.clip_grads import (
    clip_grads_by_total_norm,
    count_zeros_fp32,
    get_grad_norm_and_non_finite_count_fp32,
    get_grad_norm_fp32,
)
from mptrain.precision.optimizer import FP32Optimizer, MixedPrecisionOptimizer


def test_grad_norm_by_hand():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0], [2.0, 0.0]])]
    # 9 + 16 + 1 + 4 + 4 + 0 = 34
    norm = get_grad_norm_fp32(grads, None)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert norm.item() == pytest.approx(math.sqrt(34.0), rel=1e-7)  # one fp32 rounding of sqrt(34)
    half = [g.half() for g in grads]  # non-fp32 grads are summed in fp32
    assert get_grad_norm_fp32(half, None).item() == pytest.approx(math.sqrt(34.0), rel=1e-7)  # same: values exact in fp16
    assert get_grad_norm_fp32([], None).item() == 0.0


def test_norm_of_the_counted_grads_and_non_finite_count_of_all():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0], [2.0, 0.0]]), torch.tensor([10.0])]
    norm, bad = get_grad_norm_and_non_finite_count_fp32(grads, torch.tensor([1.0, 1.0, 0.0]), None)
    assert norm.item() == pytest.approx(math.sqrt(34.0), rel=1e-7) and bad.item() == 0.0  # the 10 does not count
    grads[2][0] = float("inf")  # an uncounted grad is still checked
    norm, bad = get_grad_norm_and_non_finite_count_fp32(grads, torch.tensor([1.0, 1.0, 0.0]), None)
    assert bad.item() == 1.0
    norm, bad = get_grad_norm_and_non_finite_count_fp32([], torch.zeros(0), None)
    assert (norm.item(), bad.item()) == (0.0, 0.0)


def test_clip_engaged_and_not():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 12.0])]  # norm 13
    clip_grads_by_total_norm(grads, 26.0, 13.0)  # coef 2 > 1: untouched
    assert grads[0].tolist() == [3.0, 4.0] and grads[1].tolist() == [0.0, 12.0]
    clip_grads_by_total_norm(grads, 1.0, torch.tensor(13.0))  # tensor path, coef 1 / (13 + 1e-6)
    coef = 1.0 / (13.0 + 1e-6)
    # rel 1e-6: fp32 product of fp32-rounded coef and the grad (two roundings of ~6e-8 each)
    torch.testing.assert_close(grads[0], torch.tensor([3.0, 4.0]) * coef, rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[1], torch.tensor([0.0, 12.0]) * coef, rtol=1e-6, atol=0)
    assert get_grad_norm_fp32(grads, None).item() == pytest.approx(1.0, rel=1e-6)  # same two roundings
    g = [torch.tensor([3.0, 4.0])]
    clip_grads_by_total_norm(g, 1.0, 5.0)  # float path, coef 1 / (5 + 1e-6)
    assert g[0].tolist() == pytest.approx([0.6, 0.8], rel=1e-6)  # 1e-6: fp32 rounding + the 1e-6 epsilon (2e-7 rel)
    g = [torch.tensor([3.0, 4.0])]
    clip_grads_by_total_norm(g, 0.0, 5.0)  # max_norm 0: clipping off
    assert g[0].tolist() == [3.0, 4.0]


def test_count_zeros():
    grads = [torch.tensor([0.0, 1.0, 0.0]), torch.tensor([[0.0, -0.0], [2.0, 3.0]])]
    assert count_zeros_fp32(grads, None).item() == 4.0  # -0.0 == 0 counts


# --- distributed: TP-replicated params counted once; tp2pp2 == tp1pp1 -------------------------------------------
# A "full model" of four tensors (the layout-independent truth), split like a GPT chunk would be:
#   emb   [8, 3]  vocab-parallel (partition_dim 0), tied: first stage holds it, last stage holds a shared copy
#   qkv   [6, 4]  column-parallel (partition_dim 0), on pp stage 0
#   ln    [4]     replicated over TP (no_weight_decay), on pp stage 1
#   proj  [4, 6]  row-parallel (partition_dim 1), on pp stage 1
def _full_grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) for n, shape in
            (("emb", (8, 3)), ("qkv", (6, 4)), ("ln", (4,)), ("proj", (4, 6)))}


def _local_params(tp, pp, tp_rank, pp_rank, dtype, seed=0):
    """[(param, spec, grad)] this rank holds; every param value = 1 + index, grads from the full tensors."""
    full = _full_grads(seed)
    out = []

    def shard(name, dim, **flags):
        g = full[name]
        size = g.shape[dim] // tp if dim is not None else None
        local = g if dim is None else g.narrow(dim, tp_rank * size, size)
        spec = ShardSpec(tuple(g.shape), partition_dim=dim, offset=0 if dim is None else tp_rank * size, **flags)
        param = torch.nn.Parameter(torch.ones_like(local, dtype=dtype))
        out.append((param, spec, local.clone().to(dtype)))

    if pp_rank == 0:
        shard("emb", 0, tied_embedding=True)
        shard("qkv", 0)
    if pp_rank == pp - 1:
        if pp > 1:
            shard("emb", 0, tied_embedding=True, is_shared_copy=True)  # the last stage's copy: never counted
        shard("ln", None, no_weight_decay=True)
        shard("proj", 1)
    return out


def _reference_norm(seed=0):
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in _full_grads(seed).values()))


def _norm_on_layout(rank, world, tp, pp, clip, dtype_name):
    dtype = getattr(torch, dtype_name)
    groups = build_groups(tp, pp)
    try:
        triples = _local_params(tp, pp, groups.tp_rank, groups.pp_rank, dtype)
        grads = {id(p): g for p, _, g in triples}
        wrapper = FP32Optimizer if dtype == torch.float32 else MixedPrecisionOptimizer
        opt = wrapper(build_optimizer_factory(OptimConfig(_target_="torch.optim.SGD", lr=1.0)), [p for p, _, _ in triples],
                      [s for _, s, _ in triples], lambda p: grads[id(p)], groups,
                      scaler=None, clip_grad=clip, max_consecutive_skips=0, log_num_zeros=True)
        # the function alone, on counted grads only
        counted = [g.float() for p, s, g in triples if s.counts_on(groups.tp_rank)]
        direct = get_grad_norm_fp32(counted, groups.mp_group).item()
        originals = [g.float().clone() for _, _, g in triples]  # fp32 grads are clipped in place (aliased)
        result = opt.step().result()
        # SGD lr 1 from params = 1: the applied (clipped) update is 1 - p
        updates = [(1.0 - p.detach().float()) for p, _, _ in triples]
        applied_vs_grad = [float((u - g).abs().max()) for u, g in zip(updates, originals)]
        # least-squares ratio update / grad (weights elements by g^2, so tiny grads add no rounding noise)
        ratios = [float((u * g).sum() / (g ** 2).sum()) for u, g in zip(updates, originals)]
        return direct, result.grad_norm, result.num_zeros, applied_vs_grad, ratios
    finally:
        groups.destroy()


@pytest.mark.parametrize("tp, pp, world", [(1, 1, 1), (2, 1, 2), (2, 2, 4)])
def test_grad_norm_counts_every_element_once(tp, pp, world):
    ref = _reference_norm()
    out = run_distributed(_norm_on_layout, world, tp, pp, 0.0, "float32")
    for direct, stepped, num_zeros, applied_vs_grad, _ in out:
        # rel 1e-5 (the required tolerance): fp32 sums of squares in a different order per layout
        assert direct == pytest.approx(ref, rel=1e-5)
        assert stepped == pytest.approx(ref, rel=1e-5)
        assert num_zeros == 0
        # clip_grad 0: SGD applied the raw grad; 1e-6 abs: p = 1 - g is rounded in fp32 (|1 - g| < 4, ulp <= 4.8e-7)
        assert max(applied_vs_grad) < 1e-6
    # every rank of the grad-stats group reports the same norm
    assert len({round(o[1], 6) for o in out}) == 1


@pytest.mark.parametrize("tp, pp, world", [(1, 1, 1), (2, 2, 4)])
def test_clipping_engaged_scales_every_grad_by_the_same_coefficient(tp, pp, world):
    ref = _reference_norm()
    max_norm = 0.5 * ref  # engaged: coef ~ 0.5
    out = run_distributed(_norm_on_layout, world, tp, pp, max_norm, "float32")
    for _, stepped, _, _, ratios in out:
        assert stepped == pytest.approx(ref, rel=1e-5)  # the norm is reported before clipping
        for r in ratios:
            # 1e-5: coef computed from an fp32 norm that agrees with ref to 1e-5; the updates are fp32 products
            assert r == pytest.approx(max_norm / (ref + 1e-6), rel=1e-5)


def test_grad_norm_with_bf16_params_and_fp32_main_grads_at_tp2pp2():
    ref = _reference_norm()
    out = run_distributed(_norm_on_layout, 4, 2, 2, 0.0, "bfloat16")
    for direct, stepped, *_ in out:
        # bf16 grads (8-bit mantissa) summed in fp32: each element rel error <= 2^-9, so the norm within 4e-3
        assert stepped == pytest.approx(ref, rel=4e-3)
        assert direct == pytest.approx(stepped, rel=1e-6)  # same bf16 values, both summed in fp32


def _found_inf_from_one_rank(rank, world):
    groups = build_groups(world, 1)  # one TP group = the mp group of 2 ranks
    try:
        grads = [torch.tensor([1.0, 2.0]), torch.tensor([float("nan") if rank == 1 else 0.0])]
        return get_grad_norm_fp32(grads, groups.mp_group).item(), count_zeros_fp32(grads, groups.mp_group).item()
    finally:
        groups.destroy()


def test_nan_propagates_through_the_norm_and_zeros_are_summed():
    out = run_distributed(_found_inf_from_one_rank, 2)
    assert all(math.isnan(n) for n, _ in out)
    assert [z for _, z in out] == [1.0, 1.0]  # rank 0 has one zero, rank 1 none (nan != 0)

