"""finalize_model_grads: SP grads over TP, tied embedding over the embedding group, token normalisation."""

from __future__ import annotations

import torch

from harness import run_distributed
from mptrain.distributed import DistributedDataParallel, finalize_model_grads
from mptrain.groups import build_groups
from mptrain.layers.sharding import ShardSpec


class _Params(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.zeros(3))  # replicated over TP, sequence-parallel grad
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))  # TP-sharded: never reduced over TP
        self.emb = torch.nn.Parameter(torch.zeros(4))  # stands in for the tied embedding


SPECS = {
    "norm": ShardSpec(global_shape=(3,), sequence_parallel_grad=True, no_weight_decay=True),
    "weight": ShardSpec(global_shape=(4, 2), partition_dim=0),
    "emb": ShardSpec(global_shape=(4,), tied_embedding=True),
}


def _finalize(rank, world, tp, pp, distopt, num_tokens_by_dp):
    groups = build_groups(tp, pp)
    try:
        mod = _Params()
        ddp = DistributedDataParallel(mod, groups, specs=SPECS, grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                      bucket_size=None, use_distributed_optimizer=distopt)
        for p in mod.parameters():
            ddp.main_grad(p).fill_(float(rank + 1))  # local grad = rank + 1 everywhere
        tokens = None
        if groups.is_last_stage:
            tokens = torch.tensor(float(num_tokens_by_dp[groups.dp_rank]))
        elif rank % 2:
            tokens = torch.tensor(123.0)  # garbage on non-last stages must be ignored
        total = finalize_model_grads([ddp], groups, num_tokens=tokens, max_tokens=60)
        grads = {n: ddp.main_grad(p).clone() for n, p in mod.named_parameters()}
        shard = None
        if distopt:
            buf = ddp.grad_buffers[0]
            shard = [(buf.slot(p).name, buf.slot(p).start, buf.slot(p).end) for p in buf.params()]
        return {"total": float(total), "grads": grads, "coords": (groups.tp_rank, groups.dp_rank, groups.pp_rank),
                "ranks": groups.ranks, "shard": shard}
    finally:
        groups.destroy()


def _expected(r, results, name, factor):
    """Sum over the ranks each reduction covers, of (rank + 1), times the normalisation factor."""
    dp_ranks = r["ranks"]["dp"]

    def dp_sum(ranks):
        return sum(q + 1 for q in ranks)

    if name == "weight":
        return dp_sum(dp_ranks) * factor
    if name == "norm":  # DP then TP: the DP sums of every member of my TP group
        return sum(dp_sum(results[t]["ranks"]["dp"]) for t in r["ranks"]["tp"]) * factor
    # tied: DP, then the embedding group (first + last stage) when pp > 1
    emb = r["ranks"]["embedding"]
    if emb is None or len(emb) == 1:
        return dp_sum(dp_ranks) * factor
    return sum(dp_sum(results[e]["ranks"]["dp"]) for e in emb) * factor


def _check(results, num_tokens_by_dp):
    total = sum(num_tokens_by_dp)
    for r in results:
        assert r["total"] == total  # broadcast from the last stage over PP, SUM over DP: exact integers
        factor = 60 / total
        for name, g in r["grads"].items():
            # integer sums times one fp32 rounding of 60/total, then one fp32 multiply: rel 1e-6
            torch.testing.assert_close(g, torch.full_like(g, _expected(r, results, name, factor)), rtol=1e-6, atol=0)


def test_tp2_sequence_parallel_grads_and_tokens():
    results = run_distributed(_finalize, 2, 2, 1, False, [7])
    _check(results, [7])


def test_tp2_pp2_tied_and_tokens_world8():
    # world 8 = tp 2 x dp 2 x pp 2: every reduction at once (the 8-process layout)
    results = run_distributed(_finalize, 8, 2, 2, False, [5, 11])
    _check(results, [5, 11])


def test_pp2_dp2_tied_with_distributed_optimizer():
    results = run_distributed(_finalize, 4, 1, 2, True, [3, 4])
    total = 7
    for r in results:
        assert r["total"] == total
        # under ZeRO-1 only this rank's shard of every bucket is reduced over DP; the tied param
        # sits alone in its bucket, so check its shard: emb (4 elements, dp 2) -> 2 per rank.
        buf_names = [s[0] for s in r["shard"]]
        assert "emb" in buf_names
        g = r["grads"]["emb"].reshape(-1)
        dp_rank = r["coords"][1]
        mine = g[2 * dp_rank : 2 * dp_rank + 2]
        torch.testing.assert_close(mine, torch.full_like(mine, _expected(r, results, "emb", 60 / total)), rtol=1e-6, atol=0)
