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
