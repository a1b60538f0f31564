"""DistributedOptimizer (ZeRO-1): its listed checkpoint state (flat pieces), reloaded under another DP size."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from test_ddp import build_stage, full_weights, listed_state, train
from mptrain.distributed import DistributedDataParallel, DistributedOptimizer
from mptrain.groups import build_groups
from mptrain.precision import WrapperState
from mptrain.optim.builders import build_optimizer_factory
from mptrain.config.optim import OptimConfig


def _merge_states(results) -> dict:
    """{name: [pieces from every rank]} (what a checkpoint holds: pieces addressed by flat range)."""
    merged: dict = {}
    for r in results:
        for piece in r["opt_state"]["params"]:
            merged.setdefault(piece["name"], []).append(piece)
    return merged


def _assemble(pieces: list, get, numel: int) -> torch.Tensor:
    """The full flat tensor of one param from its saved pieces (what a checkpoint read does)."""
    full = torch.zeros(numel)
    for piece in pieces:
        a, b = piece["flat_range"]
        full[a:b] = get(piece)
    return full


def _reload(rank, world, merged, params):
    """Fresh dp=`world` optimizer loading pieces saved at another DP size through its
    `load_sharded_state_dict`; return its listed state."""
    groups = build_groups(1, 1)
    try:
        stage = build_stage(groups, full_weights())
        for n, p in stage.named_parameters():
            p.data.copy_(params[n])
        ddp = DistributedDataParallel(stage, groups, specs=stage.specs(), grad_reduce_in_fp32=False,
                                      overlap_grad_reduce=False, bucket_size=200, use_distributed_optimizer=True)
        opt = DistributedOptimizer(build_optimizer_factory(OptimConfig(_target_="torch.optim.Adam", lr=1e-2)), [ddp], groups)
        names = {id(p): n for n, p in stage.named_parameters()}
        own = opt.sharded_state_dict()
        with torch.no_grad():
            for piece in own.params:
                saved = merged[names[id(piece.param)]]
                lo, hi = piece.flat_range
                numel = piece.param.numel()
                piece.main.copy_(_assemble(saved, lambda x: x["main_param"], numel)[lo:hi])
                piece.state = {key: (_assemble(saved, lambda x, k=key: x["state"][k], numel)[lo:hi]
                                     if isinstance(value, torch.Tensor) and value.dim() == 1 else value)
                               for key, value in saved[0]["state"].items()}
        opt.load_sharded_state_dict(WrapperState(params=own.params, counters={"skipped_iters_total": 2}))
        return listed_state(opt, stage), opt.skipped_iters_total
    finally:
        groups.destroy()


def test_state_dict_reloads_under_another_dp_size():
    saved = run_distributed(train, 2, distopt=True, steps=2, bucket_size=300, return_state=True)
    merged = _merge_states(saved)
    numel = {n: p.numel() for n, p in full_weights().items()}
    for name, pieces in merged.items():
        # the pieces of one param from both ranks tile [0, numel) exactly once
        covered = sorted(tuple(p["flat_range"]) for p in pieces)
        assert covered[0][0] == 0 and covered[-1][1] == numel[name]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    reloaded = run_distributed(_reload, 4, merged, saved[0]["params"])
    for state, skipped in reloaded:
        assert skipped == 2
        for entry in state["params"]:
            name = entry["name"]
            lo, hi = entry["flat_range"]
            for key in ("exp_avg", "exp_avg_sq"):
                full = torch.zeros(numel[name])
                for piece in merged[name]:
                    a, b = piece["flat_range"]
                    full[a:b] = piece["state"][key]
                assert torch.equal(entry["state"][key], full[lo:hi])  # copied, not recomputed: exact
            assert float(entry["state"]["step"]) == 2.0
            full_main = torch.zeros(numel[name])
            for piece in merged[name]:
                a, b = piece["flat_range"]
                full_main[a:b] = piece["main_param"]
            assert torch.equal(entry["main_param"], full_main[lo:hi])


def test_rejects_ddp_without_distributed_optimizer():
    class _Fake:  # a chunk wrapped without ZeRO-1: rejected before any collective
        use_distributed_optimizer = False

    with pytest.raises(ValueError, match="use_distributed_optimizer=true"):
        DistributedOptimizer(lambda g: None, [_Fake()], None)
