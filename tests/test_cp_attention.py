"""Context-parallel attention (p2p ring and all-gather) equals causal attention over the whole sequence.

Every CP rank holds its two load-balanced chunks of q, k, v; its output and the grads of its q, k, v must
equal the single-process causal attention's rows of those chunks (fp32, 1e-5), with grouped-query heads.
"""

import pytest
import torch
import torch.nn.functional as F

from harness import run_distributed
from mptrain.errors import ConfigError
from mptrain.layers.context_parallel import chunk_bounds, local_positions, slice_batch, slice_sequence

B, NP, NG, D = 2, 4, 2, 8


def _full(seq: int):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, NP, seq, D, generator=g)
    k = torch.randn(B, NG, seq, D, generator=g)
    v = torch.randn(B, NG, seq, D, generator=g)
    dout = torch.randn(B, NP, seq, D, generator=g)
    return q, k, v, dout


def _reference(seq: int):
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_full(seq)))
    rep = NP // NG
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_task(rank, world, seq, comm_type, kernel=None):
    from mptrain.groups import build_groups
    from mptrain.layers.cp_attention import a2a_attention, all_gather_attention, ring_attention

    groups = build_groups(1, 1, context_parallel_size=world)
    try:
        local = [slice_sequence(t, 2, world, groups.cp_rank).clone() for t in _full(seq)]
        q, k, v = (t.requires_grad_() for t in local[:3])
        if comm_type == "p2p":
            out = ring_attention(q, k, v, groups, kernel)
        elif comm_type == "a2a":  # a2a and all_gather take [s, b, heads, d]
            out = a2a_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), groups)
        else:
            out = all_gather_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), groups)
        out.backward(local[3])
        return out.detach(), q.grad, k.grad, v.grad
    finally:
        groups.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_causal_attention(world):
    seq = 8 * world
    ref = _reference(seq)
    a2a = (("a2a", None),) if NG % world == 0 else ()  # a2a splits the K/V heads over cp
    for comm_type, kernel in (("p2p", None), ("p2p", "matmul"), ("all_gather", None), *a2a):
        results = run_distributed(_cp_task, world, seq, comm_type, kernel)
        for r, got in enumerate(results):
            for name, g, want in zip(("out", "dq", "dk", "dv"), got, ref):
                expect = slice_sequence(want, 2, world, r)
                torch.testing.assert_close(g, expect, rtol=1e-5, atol=1e-5, msg=f"{comm_type} {kernel} rank {r} {name}")


def test_chunks_are_load_balanced():
    assert chunk_bounds(16, 2, 0) == ((0, 4), (12, 16))
    assert chunk_bounds(16, 2, 1) == ((4, 8), (8, 12))
    assert local_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    ids = torch.arange(16).view(1, 16)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    out = slice_batch({"tokens": ids, "attention_mask": mask}, 2, 1)
    assert out["tokens"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert out["attention_mask"].shape == (1, 1, 8, 16)
    assert torch.equal(out["attention_mask"][0, 0], mask[0, 0, 4:12])


def test_context_parallel_rules():
    from mptrain.config.data import DataConfig
    from mptrain.config.model import ModelConfig
    from mptrain.config.parallel import ParallelConfig
    from mptrain.layers.context_parallel import check_context_parallel

    model = ModelConfig(seq_length=60, attention_dropout=0.0)
    with pytest.raises(ConfigError, match=r"^model.seq_length=60 is not divisible by 2 × parallel.context_parallel_size = 8"):
        check_context_parallel(ParallelConfig(context_parallel_size=4), model)
    with pytest.raises(ConfigError, match="parallel.cp_comm_type"):
        check_context_parallel(ParallelConfig(cp_comm_type="ring"), model)
    mask = DataConfig(reset_attention_mask=True)
    with pytest.raises(ConfigError, match="needs parallel.cp_comm_type=all_gather"):
        check_context_parallel(ParallelConfig(context_parallel_size=2), model, mask)
    with pytest.raises(ConfigError, match="needs data.create_attention_mask_in_dataloader=true"):
        check_context_parallel(ParallelConfig(context_parallel_size=2, cp_comm_type="all_gather"), model, mask)
    dense = DataConfig(reset_attention_mask=True, create_attention_mask_in_dataloader=True)
    check_context_parallel(ParallelConfig(context_parallel_size=2, cp_comm_type="all_gather"), model, dense)
    gqa = ModelConfig(seq_length=64, num_attention_heads=8, num_query_groups=2)
    with pytest.raises(ConfigError, match="parallel.cp_comm_type=a2a splits each TP rank's heads"):
        check_context_parallel(ParallelConfig(context_parallel_size=4, cp_comm_type="a2a"), gqa)
    check_context_parallel(ParallelConfig(context_parallel_size=2, cp_comm_type="a2a"), gqa)


def test_start_up_validation_names_cp_in_one_line():
    from mptrain.training.validate import validate_config
    from train_utils import compose

    base = ["model=tiny", "train.global_batch_size=4", "train.micro_batch_size=2"]
    with pytest.raises(ConfigError, match=r"^parallel: world size 6 is not divisible by tensor_model_parallel_size × "
                                          r"context_parallel_size × pipeline_model_parallel_size = 1 × 4 × 1 = 4;"):
        validate_config(compose(base + ["parallel.context_parallel_size=4"]), 6)
    with pytest.raises(ConfigError, match=r"^model.seq_length=60 is not divisible by 2 × parallel.context_parallel_size"):
        validate_config(compose(base + ["parallel.context_parallel_size=4", "model.seq_length=60"]), 4)
    derived = validate_config(compose(base + ["parallel.context_parallel_size=2", "parallel=tp2pp1"]), 8)
    assert (derived.context_parallel_size, derived.data_parallel_size, derived.num_microbatches) == (2, 2, 1)
