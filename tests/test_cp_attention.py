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


def _cu(starts: list, seq: int) -> list:
    """A ``cu_seqlens`` row: the documents' starts, then ``seq`` up to the width seq + 1."""
    return starts + [seq] * (seq + 1 - len(starts))


# s = 32 in 2·cp chunks. cp2 (chunks of 8): documents [0,3) [3,7) [7,24) [24,32) in both sequences give every kind of
# block: a diagonal cut by a boundary (masked), diagonals and a pair inside one document (causal / full: rank 1's
# step 0 is the plain causal block), pairs no query may see (rank 0's whole step 1 is skipped). cp4 (chunks of 4):
# sequences with different documents, so a block is full or empty only where both agree.
DOCUMENTS = {2: [_cu([0, 3, 7, 24], 32)] * B, 4: [_cu([0, 5, 13, 14], 32), _cu([0, 6], 32)]}


def _reference(seq: int, cu=None):
    """Causal attention over the whole sequence (within the documents of ``cu``): out, dq, dk, dv."""
    from mptrain.layers.document_mask import DocumentMask

    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_full(seq)))
    rep = NP // NG
    mask = None if cu is None else ~DocumentMask(torch.tensor(cu)).dense()  # [b, 1, s, s], True = may attend
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask, is_causal=cu is None)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_task(rank, world, seq, comm_type, kernel=None, cu=None):
    from mptrain.groups import build_groups
    from mptrain.layers.cp_attention import a2a_attention, all_gather_attention, ring_attention
    from mptrain.layers.document_mask import DocumentMask

    groups = build_groups(1, 1, context_parallel_size=world)
    documents = None if cu is None else DocumentMask(torch.tensor(cu))  # the whole sequence's, on every rank
    try:
        local = [slice_sequence(t, 2, world, groups.cp_rank).clone() for t in _full(seq)]
        q, k, v = (t.requires_grad_() for t in local[:3])
        if comm_type == "p2p":
            out = ring_attention(q, k, v, groups, kernel, documents=documents)
        elif comm_type == "a2a":  # a2a and all_gather take [s, b, heads, d]
            out = a2a_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), groups, documents)
        else:
            out = all_gather_attention(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), groups, documents)
        out.backward(local[3])
        return out.detach(), q.grad, k.grad, v.grad
    finally:
        groups.destroy()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("documents", [False, True])
def test_cp_attention_equals_causal_attention(world, documents):
    seq = 8 * world if not documents else 32
    cu = DOCUMENTS[world] if documents else None
    ref = _reference(seq, cu)
    a2a = (("a2a", None),) if NG % world == 0 else ()  # a2a splits the K/V heads over cp
    for comm_type, kernel in (("p2p", None), ("p2p", "matmul"), ("all_gather", None), *a2a):
        results = run_distributed(_cp_task, world, seq, comm_type, kernel, cu)
        for r, got in enumerate(results):
            for name, g, want in zip(("out", "dq", "dk", "dv"), got, ref):
                expect = slice_sequence(want, 2, world, r)
                torch.testing.assert_close(g, expect, rtol=1e-5, atol=1e-5,
                                           msg=f"{comm_type} {kernel} documents={documents} rank {r} {name}")


def test_the_ring_skips_the_blocks_no_query_may_see():
    from mptrain.layers.cp_blocks import causal_plan, document_plan
    from mptrain.layers.document_mask import DocumentMask

    mask = DocumentMask(torch.tensor(DOCUMENTS[2]))
    kinds = {r: [[(b.rows, b.cols, b.kind) for b in step] for step in document_plan(mask, 2, r)] for r in (0, 1)}
    first, second = slice(0, 8), slice(8, 16)
    # rank 0 (chunks 0, 3): chunk 0 holds three documents, chunk 3 one; chunk 3's document starts after chunk 0's
    # and after all of rank 1's chunks: no block at step 1
    assert kinds[0] == [[(first, first, "masked"), (second, second, "causal")], []]
    # rank 1 (chunks 1, 2 inside one document): its own step is plain causal attention; chunk 0 is cut
    assert kinds[1] == [[(slice(None), slice(None), "causal")],
                        [(first, first, "masked"), (second, first, "masked")]]
    step1 = document_plan(mask, 2, 1)[1][0]
    assert step1.visible.shape == (B, 1, 8, 8)
    assert torch.equal(step1.visible[0, 0], ~mask.dense()[0, 0, 8:16, 0:8])  # chunk 1 sees chunk 0's [7, 8) only
    assert document_plan(mask, 2, 1) is document_plan(mask, 2, 1)  # built once per micro-batch
    one = DocumentMask(torch.tensor([_cu([0], 32)] * B))  # one document: the causal plan itself
    for r in (0, 1):
        assert document_plan(one, 2, r) == causal_plan(2, r, 16)


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
    offsets = DataConfig(reset_attention_mask=True)  # document offsets: every cp_comm_type
    for comm_type in ("p2p", "all_gather", "a2a"):
        check_context_parallel(ParallelConfig(context_parallel_size=2, cp_comm_type=comm_type), model, offsets)
    dense = DataConfig(reset_attention_mask=True, create_attention_mask_in_dataloader=True)
    check_context_parallel(ParallelConfig(context_parallel_size=2, cp_comm_type="all_gather"), model, dense)
    for comm_type in ("p2p", "a2a"):  # the dense mask's rows: all_gather only
        with pytest.raises(ConfigError, match=r"^data.create_attention_mask_in_dataloader=true with parallel."
                                              r"context_parallel_size=2 needs parallel.cp_comm_type=all_gather "
                                              rf"\(cp_comm_type={comm_type} takes the document offsets\); set "
                                              r"data.create_attention_mask_in_dataloader=false$"):
            check_context_parallel(ParallelConfig(context_parallel_size=2, cp_comm_type=comm_type), model, dense)
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
