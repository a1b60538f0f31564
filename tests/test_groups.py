"""Process groups: Megatron's rank lists (pure) and real gloo groups (world 8)."""

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from mptrain.errors import ConfigError
from mptrain.groups import build_groups, rank_coordinates, rank_groups


def test_design_document_example_world16_tp2_pp4():
    g = rank_groups(16, 2, 4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_world8_tp2_pp2():
    g = rank_groups(8, 2, 2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_world12_tp2_pp3():
    g = rank_groups(12, 2, 3)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]]
    assert g["pp"] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert g["mp"] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert g["embedding"] == [[0, 8], [1, 9], [2, 10], [3, 11]]


def test_pp1_embedding_is_first_rank_only():
    g = rank_groups(4, 2, 1)
    assert g["embedding"] == [[0], [1], [2], [3]]
    assert g["dp"] == [[0, 2], [1, 3]]


def _layouts(max_world=64):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world + 1):
                if world % (tp * pp) == 0:
                    yield world, tp, pp


def test_every_layout_up_to_64_partitions_and_is_consistent():
    n = 0
    for world, tp, pp in _layouts():
        g = rank_groups(world, tp, pp)
        dp = world // (tp * pp)
        for kind, size in (("tp", tp), ("pp", pp), ("dp", dp), ("mp", tp * pp)):
            flat = sorted(r for grp in g[kind] for r in grp)
            assert flat == list(range(world)), (world, tp, pp, kind)
            assert all(len(grp) == size for grp in g[kind]), (world, tp, pp, kind)
        for grp in g["tp"]:
            assert grp == list(range(grp[0], grp[0] + tp))  # contiguous
        coords = {rank_coordinates(r, world, tp, pp) for r in range(world)}
        assert len(coords) == world
        for r in range(world):
            t, d, p = rank_coordinates(r, world, tp, pp)
            assert g["tp"][d + dp * p][t] == r
            assert g["pp"][t + tp * d][p] == r
        n += 1
    assert n > 500


@pytest.mark.parametrize(
    "args, key",
    [((6, 2, 2), "world size 6 is not divisible"), ((4, 0, 1), "must all be >= 1"), ((8, 3, 1), "divisible")],
)
def test_bad_layouts_raise_config_error(args, key):
    with pytest.raises(ConfigError, match=key):
        rank_groups(*args)


def test_vpp_without_pp_is_rejected():
    from mptrain.groups import validate_layout

    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"):
        validate_layout(4, 2, 1, 2)


def _allreduce_each_group(rank, world):
    groups = build_groups(2, 2)
    try:
        expected_lists = rank_groups(world, 2, 2)
        out = {}
        for kind in ("tp", "pp", "dp", "mp", "embedding"):
            mine = groups.ranks[kind]
            assert mine in expected_lists[kind]
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=groups.handles[kind])
            out[kind] = t.item()
            assert out[kind] == float(sum(mine)), (kind, mine, out[kind])
        facts = (groups.tp_rank, groups.dp_rank, groups.pp_rank, groups.is_first_stage, groups.is_last_stage,
                 groups.next_pp_rank, groups.prev_pp_rank, groups.tp_src_rank, groups.dp_size)
        return facts
    finally:
        groups.destroy()


def test_gloo_world8_tp2_pp2_dp2():
    facts = run_distributed(_allreduce_each_group, 8)
    for rank, f in enumerate(facts):
        tp, dp, pp = rank_coordinates(rank, 8, 2, 2)
        assert f[:3] == (tp, dp, pp)
        assert f[3] == (pp == 0) and f[4] == (pp == 1)
        other = rank + 4 if pp == 0 else rank - 4
        assert f[5] == other and f[6] == other
        assert f[7] == rank - tp
        assert f[8] == 2


def _two_layouts(rank, world):
    out = []
    for tp, pp in ((2, 1), (1, 2), (4, 1)):
        g = build_groups(tp, pp)
        try:
            t = torch.ones(1)
            dist.all_reduce(t, group=g.tp_group)
            out.append(t.item())
        finally:
            g.destroy()
    return out


def test_layouts_built_one_after_another():
    assert run_distributed(_two_layouts, 4) == [[2.0, 1.0, 4.0]] * 4


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()


def test_harness_reports_failing_rank(monkeypatch):
    import harness
    from harness import DistributedTestError

    # rank 0 blocks in the barrier: the pool waits the grace for more errors, then kills it (suite time: 1 s, not 5)
    monkeypatch.setattr(harness, "_GRACE_S", 1.0)
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
        run_distributed(_fail_on_rank1, 2, timeout_s=60)
    assert run_distributed(_two_layouts_small, 2) == [2.0, 2.0]  # a fresh pool works afterwards


def _two_layouts_small(rank, world):
    g = build_groups(2, 1)
    try:
        t = torch.ones(1)
        dist.all_reduce(t, group=g.tp_group)
        return t.item()
    finally:
        g.destroy()


# --- the expert grid (Megatron-core's expert RankGenerator, order tp-ep-dp-pp) ---------------------
# Lists printed by Megatron-LM's own `RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1,
# order="tp-cp-ep-dp-pp").get_ranks(...)` (megatron/core/parallel_state.py), tokens "ep", "tp", "dp", "tp-ep".
MEGATRON_EXPERT_GROUPS = {
    # (world, tp, pp, ep, etp): {kind: lists}
    (8, 2, 2, 2, 1): {
        "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "etp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp_ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
    (8, 2, 1, 2, 2): {
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
    },
    (8, 1, 2, 2, 2): {
        "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "edp": [[0], [1], [2], [3], [4], [5], [6], [7]],
        "tp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
    },
    (4, 2, 1, 2, None): {  # etp null = tp
        "ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]], "edp": [[0], [1], [2], [3]], "tp_ep": [[0, 1, 2, 3]],
    },
}


@pytest.mark.parametrize("layout", list(MEGATRON_EXPERT_GROUPS))
def test_expert_groups_are_megatrons(layout):
    world, tp, pp, ep, etp = layout
    g = rank_groups(world, tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    for kind, lists in MEGATRON_EXPERT_GROUPS[layout].items():
        assert g[kind] == lists, kind


def test_expert_worked_example_world16_tp2_pp2_ep4_etp1():
    """The groups module docstring's example (Megatron's MoE "parallel folding": EP over TP pairs of two DP replicas)."""
    g = rank_groups(16, 2, 2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert g["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["etp"] == [[r] for r in range(16)]
    assert g["tp_ep"] == g["ep"]
    assert g["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]  # the dense grid is unchanged


def _masked_orthogonal(world, sizes, mask):
    """Megatron's `generate_masked_orthogonal_rank_groups`, restated: rank = sum idx_i * stride_i (first axis
    fastest); a group fixes the unmasked indices (groups enumerated first-unmasked-fastest) and runs the masked ones."""
    import itertools

    strides = [1]
    for s in sizes[:-1]:
        strides.append(strides[-1] * s)

    def combos(axes):  # index tuples over `axes`, the first axis fastest
        return [dict(zip(axes, reversed(c))) for c in itertools.product(*[range(sizes[a]) for a in reversed(axes)])]

    masked = [i for i, m in enumerate(mask) if m]
    unmasked = [i for i, m in enumerate(mask) if not m]
    return [[sum(strides[a] * i for a, i in {**fixed, **run}.items()) for run in combos(masked)]
            for fixed in combos(unmasked)]


def test_every_expert_layout_up_to_16_matches_the_rank_formula():
    from mptrain.groups import expert_rank_coordinates

    n = 0
    for world, tp, pp in _layouts(16):
        for ep in range(1, world // pp + 1):
            for etp in range(1, world // pp + 1):
                if world % (etp * ep * pp):
                    continue
                edp = world // (etp * ep * pp)
                g = rank_groups(world, tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
                sizes = [etp, ep, edp, pp]
                for kind, mask in (("etp", [1, 0, 0, 0]), ("ep", [0, 1, 0, 0]), ("edp", [0, 0, 1, 0]),
                                   ("tp_ep", [1, 1, 0, 0]), ("pp", [0, 0, 0, 1])):
                    assert g[kind] == _masked_orthogonal(world, sizes, mask), (world, tp, pp, ep, etp, kind)
                for r in range(world):
                    t, e, d, p = expert_rank_coordinates(r, world, etp, ep, pp)
                    assert g["ep"][t + etp * (d + edp * p)][e] == r
                    assert g["etp"][e + ep * (d + edp * p)][t] == r
                    assert g["edp"][t + etp * (e + ep * p)][d] == r
                n += 1
    assert n > 600


@pytest.mark.parametrize(
    "args, kwargs, key",
    [((4, 1, 1), {"expert_model_parallel_size": 3},
      "world size 4 is not divisible by expert_tensor_parallel_size × expert_model_parallel_size × "
      "pipeline_model_parallel_size = 1 × 3 × 1 = 3; set parallel.expert_model_parallel_size to one of [1, 2, 4], "
      "or run with --nproc_per_node=3"),
     ((4, 2, 1), {"expert_tensor_parallel_size": 4, "expert_model_parallel_size": 2},
      "= 4 × 2 × 1 = 8; set parallel.expert_model_parallel_size to one of [1], or run with --nproc_per_node=8"),
     ((4, 1, 1), {"expert_model_parallel_size": 0}, "parallel.expert_model_parallel_size=0 must be >= 1"),
     ((4, 1, 1), {"expert_tensor_parallel_size": 0}, "parallel.expert_tensor_parallel_size=0 must be >= 1, or null")],
)
def test_bad_expert_layouts_raise_config_error(args, kwargs, key):
    from mptrain.groups import validate_layout

    with pytest.raises(ConfigError) as err:
        validate_layout(*args, **kwargs)
    assert key in str(err.value)


def _expert_groups(rank, world, tp, ep, etp):
    groups = build_groups(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    try:
        expected = rank_groups(world, tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        sums = {}
        for kind, handle in (("ep", groups.ep_group), ("etp", groups.etp_group), ("edp", groups.edp_group),
                             ("tp_ep", groups.tp_ep_group)):
            assert groups.ranks[kind] in expected[kind], kind
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=handle)
            sums[kind] = t.item()
            assert dist.get_process_group_ranks(handle) == groups.ranks[kind], kind
        aliases = {kind: groups.handles[kind] is groups.handles[dense] for kind, dense in
                   (("etp", "tp"), ("edp", "dp"), ("tp_ep", "tp"))}
        facts = (groups.ep_rank, groups.ep_size, groups.etp_rank, groups.etp_size, groups.edp_rank, groups.edp_size)
        return sums, aliases, facts, len(groups.all_groups)
    finally:
        groups.destroy()


def test_gloo_world4_expert_groups_reduce_over_their_ranks():
    # tp2 ep2 etp1 (EP folded over the TP pairs): EP [0,1] [2,3], EDP [0,2] [1,3], ETP singletons
    out = run_distributed(_expert_groups, 4, 2, 2, 1)
    assert [o[0] for o in out] == [{"ep": 1.0, "etp": 0.0, "edp": 2.0, "tp_ep": 1.0}, {"ep": 1.0, "etp": 1.0, "edp": 4.0, "tp_ep": 1.0},
                                   {"ep": 5.0, "etp": 2.0, "edp": 2.0, "tp_ep": 5.0}, {"ep": 5.0, "etp": 3.0, "edp": 4.0, "tp_ep": 5.0}]
    assert [o[2] for o in out] == [(0, 2, 0, 1, 0, 2), (1, 2, 0, 1, 0, 2), (0, 2, 0, 1, 1, 2), (1, 2, 0, 1, 1, 2)]
    assert out[0][1] == {"etp": False, "edp": True, "tp_ep": True}  # EDP = dense DP, TP_EP = EP = TP here: shared
    # tp2 ep2 etp=null (= tp): ETP is TP, tp_ep is everyone, EP [0,2] [1,3]
    out = run_distributed(_expert_groups, 4, 2, 2, None)
    assert [o[0]["ep"] for o in out] == [2.0, 4.0, 2.0, 4.0] and [o[0]["tp_ep"] for o in out] == [6.0] * 4
    assert [o[2][:4] for o in out] == [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
    assert out[0][1] == {"etp": True, "edp": False, "tp_ep": False}
    # ep1: the expert groups are the dense ones; no group is created for them (EP's singletons are pp's at pp=1)
    out = run_distributed(_expert_groups, 4, 2, 1, None)
    assert out[0][1] == {"etp": True, "edp": True, "tp_ep": True}
    assert [o[2] for o in out] == [(0, 1, 0, 2, 0, 2), (0, 1, 1, 2, 0, 2), (0, 1, 0, 2, 1, 2), (0, 1, 1, 2, 1, 2)]
    dense = rank_groups(4, 2, 1)
    assert out[0][3] == sum(len(dense[kind]) for kind in ("tp", "pp", "dp", "mp", "embedding"))


def test_num_experts_rule():
    from mptrain.groups import check_num_experts

    check_num_experts(None, 1)
    check_num_experts(8, 4)
    with pytest.raises(ConfigError, match=r"model.num_moe_experts=6 is not divisible by parallel.expert_model_parallel_size=4; "
                                          r"set parallel.expert_model_parallel_size to one of \[1, 2, 3, 6\]"):
        check_num_experts(6, 4)
    with pytest.raises(ConfigError, match="parallel.expert_model_parallel_size=2 splits the experts of MoE layers, "
                                          "and model.num_moe_experts is null"):
        check_num_experts(None, 2)


def test_context_parallel_world16_tp2_cp2_pp2():
    """Megatron's rank order tp-cp-dp-pp (the module docstring's worked example): dp = 16 / (2·2·2) = 2."""
    g = rank_groups(16, 2, 2, context_parallel_size=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g["mp"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert g["embedding"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    # the expert grid folds cp into expert-data-parallel: edp = 16 / (etp 2 · ep 1 · pp 2) = 4 = dp × cp
    assert g["edp"] == g["dp_cp"]
    from mptrain.groups import cp_rank_of

    for r in range(16):
        t, d, p = rank_coordinates(r, 16, 2, 2, 2)
        c = cp_rank_of(r, 2, 2)
        assert g["cp"][p * 4 + d * 2 + t][c] == r and g["dp"][p * 4 + c * 2 + t][d] == r
        assert g["dp_cp"][p * 2 + t][d * 2 + c] == r  # dp_cp_rank = dp_rank · cp + cp_rank


def test_context_parallel_size_must_divide_the_world():
    from mptrain.groups import validate_layout

    with pytest.raises(ConfigError, match=r"^parallel: world size 6 is not divisible by tensor_model_parallel_size × "
                                          r"context_parallel_size × pipeline_model_parallel_size = 1 × 4 × 1 = 4"):
        validate_layout(6, 1, 1, context_parallel_size=4)
    assert validate_layout(8, 2, 1, context_parallel_size=2) == 2


def _cp_groups(rank, world):
    groups = build_groups(1, 2, context_parallel_size=2)
    try:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=groups.cp_group)
        u = torch.tensor([float(rank)])
        dist.all_reduce(u, group=groups.dp_cp_group)
        return groups.ranks["cp"], t.item(), groups.cp_rank, groups.dp_cp_size, u.item(), groups.dp_rank
    finally:
        groups.destroy()


def test_gloo_world4_cp2_pp2():
    out = run_distributed(_cp_groups, 4)
    assert [o[0] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[1] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o[2] for o in out] == [0, 1, 0, 1]
    assert [o[3] for o in out] == [2] * 4 and [o[4] for o in out] == [1.0, 1.0, 5.0, 5.0] and [o[5] for o in out] == [0] * 4


def test_hsdp_groups_world8_tp2_shard2():
    """The module docstring's HSDP example: dp 4 cut into shard groups of 2 consecutive DP ranks (Megatron's
    intra-instance groups) and the replicas of each shard (its inter-instance groups)."""
    g = rank_groups(8, 2, 1, data_parallel_shard_size=2)
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["dp_shard"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert g["dp_replicate"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    # 16 ranks, tp 2, pp 2, dp 4, shard 2: per PP stage as above, offset by 8
    g = rank_groups(16, 2, 2, data_parallel_shard_size=2)
    assert g["dp_shard"] == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert g["dp_replicate"] == [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]]
    # without HSDP the shard groups are the DP groups and the replicas single ranks
    g = rank_groups(8, 2, 1)
    assert g["dp_shard"] == g["dp"] and sorted(g["dp_replicate"]) == [[r] for r in range(8)]
    with pytest.raises(ConfigError, match=r"^parallel.data_parallel_shard_size=3 must divide the data-parallel size "
                                          r"4 .*one of \[1, 2, 4\] or null"):
        rank_groups(8, 2, 1, data_parallel_shard_size=3)
