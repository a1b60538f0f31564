"""Document masking without an s × s mask (`mptrain.layers.document_mask`, ``data.reset_attention_mask``).

- A document-masked model's logits equal each document run alone (per token, fp32, 1e-6).
- `document_attention` equals softmax attention under the dense mask, on whole sequences and on shifted
  query / key blocks (the offsets a context-parallel ring step passes), log-sum-exp included, for both
  backends (FlexAttention runs eagerly on CPU: its mask_mod and block mask are the CUDA path's).
- The batch's ``cu_seqlens`` are the dense mask's documents; a bad one is one line naming the key.
"""

import math

import numpy as np
import pytest
import torch

from mptrain.data.collate import collate, document_offsets
from mptrain.layers.document_mask import DocumentMask, document_attention, document_backend

EOD = 0


def _tokens(rows: list, s: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[b, s] ids in [1, vocab) with EOD at each row's given positions."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (len(rows), s), generator=g)
    for r, eods in enumerate(rows):
        tokens[r, eods] = EOD
    return tokens


def _model(position_embedding_type: str):
    from mptrain.checkpoint.offline import single_rank_groups
    from mptrain.config.model import ModelConfig
    from mptrain.config.parallel import ParallelConfig
    from mptrain.layers.gpt import build_model_chunks

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, max_position_embeddings=24,
                      position_embedding_type=position_embedding_type, hidden_dropout=0.0, attention_dropout=0.0)
    return build_model_chunks(cfg, ParallelConfig(), single_rank_groups(), vocab_size=50, seed=3)[0].eval()


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_document_masked_logits_equal_each_document_alone(position_embedding_type):
    s = 24
    tokens = _tokens([[4, 5, 15], [22], [23]], s, vocab=50)  # a one-token document; an EOD last (no new start)
    batch = collate([(np.append(t, 1), np.ones(s + 1, bool)) for t in tokens.numpy()], eod=EOD,
                    reset_position_ids=True, reset_attention_mask=True, create_attention_mask=False)
    assert batch["attention_mask"] is None
    model = _model(position_embedding_type)
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], DocumentMask(batch["cu_seqlens"]))  # [b, s, V_pad]
        pieces = 0
        for r, row in enumerate(batch["cu_seqlens"].tolist()):
            for a, z in zip(row[:-1], row[1:]):
                if z == a:
                    continue
                alone = model(batch["tokens"][r:r + 1, a:z], torch.arange(z - a)[None])  # causal, no mask
                assert (logits[r, a:z] - alone[0]).abs().max().item() <= 1e-6, (r, a, z)
                pieces += 1
    assert pieces == 7
    with torch.no_grad():  # and the documents matter: the plain causal run differs
        assert (model(batch["tokens"], batch["position_ids"]) - logits).abs().max() > 1e-2


def _dense_attention(q, k, v, masked):
    """softmax(q·kᵀ/√d, masked → -inf)·v and the log-sum-exp, fp32; rows with no key: 0 and -inf."""
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(masked, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ v, lse


CU = torch.tensor([[0, 5, 17, 18] + [40] * 37, [0] + [40] * 40])  # b = 2, s = 40; one sequence is one document
BLOCKS = [(0, 40, 0, 40), (10, 20, 0, 20), (20, 20, 0, 20), (0, 20, 20, 20), (16, 8, 8, 16), (10, 10, 15, 20)]
"""(q0, nq, k0, nk): query and key blocks; (0, 20, 20, 20) and (10, 10, 15, 20) hold queries that see none of their keys."""


@pytest.mark.parametrize("backend", ["per_document", "flex"])
def test_document_attention_equals_the_dense_mask_on_shifted_blocks(backend, monkeypatch):
    import torch.nn.attention.flex_attention as flex

    # FlexAttention's documented eager debug mode: its reference math straight, without tracing it first
    # (seconds saved; forward only, which is all a CPU can run of it)
    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8) for _ in range(3))
    mask = DocumentMask(CU)
    dense = mask.dense()  # [b, 1, s, s], True = masked
    assert torch.equal(dense, _collate_dense(CU))
    unseen = 0
    for q0, nq, k0, nk in BLOCKS:
        want, want_lse = _dense_attention(q[:, :, q0:q0 + nq], k[:, :, k0:k0 + nk], v[:, :, k0:k0 + nk],
                                          dense[:, :, q0:q0 + nq, k0:k0 + nk])
        out, lse = document_attention(q[:, :, q0:q0 + nq], k[:, :, k0:k0 + nk], v[:, :, k0:k0 + nk], mask,
                                      q_offset=q0, kv_offset=k0, return_lse=True, backend=backend)
        assert (out - want).abs().max().item() <= 1e-6, (q0, k0)
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), (q0, k0)  # a query seeing no key: -inf
        unseen += int(torch.isinf(lse).sum())
        assert (lse - want_lse).nan_to_num(0.0).abs().max().item() <= 1e-5, (q0, k0)
        if q0 == k0 and nq == nk:
            plain = document_attention(q[:, :, q0:q0 + nq], k[:, :, k0:k0 + nk], v[:, :, k0:k0 + nk], mask,
                                       q_offset=q0, kv_offset=k0, backend=backend)
            assert (plain - want).abs().max().item() <= 1e-6
    assert unseen == 2 * 3 * (20 + 5)  # (0, 20, 20, 20): every query; (10, 10, 15, 20): queries 10..14


def test_an_explicit_core_plugin_takes_the_document_mask_in_dense_form():
    from types import SimpleNamespace

    from mptrain_plugins.attention import SlidingWindowAttention

    core = SlidingWindowAttention(config=SimpleNamespace(attention_dropout=0.0),
                                  context=SimpleNamespace(sequence_parallel=False))
    torch.manual_seed(0)
    q, k, v = (torch.randn(40, 2, 3, 8) for _ in range(3))  # [s, b, heads, hn]
    mask = DocumentMask(CU)
    want = document_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), mask)  # [b, heads, s, hn]
    got = core(q, k, v, mask).view(40, 2, 3, 8).permute(1, 2, 0, 3)
    assert (got - want).abs().max().item() <= 1e-6
    assert torch.equal(core(q, k, v, mask), core(q, k, v, mask.dense()))


def _collate_dense(cu: torch.Tensor) -> torch.Tensor:
    """The data path's dense mask of the token rows whose EODs end the documents of ``cu``."""
    s = cu.shape[1] - 1
    tokens = np.ones((cu.shape[0], s + 1), dtype=np.int64)
    for r, row in enumerate(cu.tolist()):
        for start in row[1:]:
            if start < s:
                tokens[r, start - 1] = EOD
    batch = collate([(t, np.ones(s + 1, bool)) for t in tokens], eod=EOD, reset_attention_mask=True)
    assert torch.equal(batch["cu_seqlens"], cu)  # the offsets collate makes are the ones given
    return batch["attention_mask"]


def test_document_offsets_and_backend_choice():
    tokens = np.array([[5, EOD, EOD, 7, EOD], [1, 2, 3, 4, 5], [EOD, 1, 2, 3, 4]])
    assert document_offsets(tokens, EOD).tolist() == [[0, 2, 3, 5, 5, 5], [0, 5, 5, 5, 5, 5], [0, 1, 5, 5, 5, 5]]
    assert DocumentMask(torch.from_numpy(document_offsets(tokens, EOD))).document_ids().tolist() == [
        [0, 0, 1, 2, 2], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]]
    assert document_backend(torch.device("cpu"), head_dim=64) == "per_document"
    assert document_backend(torch.device("cuda"), head_dim=64) == "flex"
    assert document_backend(torch.device("cuda"), head_dim=64, dropout_p=0.1) == "per_document"
    assert document_backend(torch.device("cuda"), head_dim=512) == "per_document"
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"queries \[3, 7\) and keys \[0, 4\) must lie in the mask's sequence of 5"):
        document_attention(q, q, q, DocumentMask(torch.tensor([[0, 5, 5, 5, 5, 5]])), q_offset=3)


def test_a_bad_cu_seqlens_is_one_line():
    from mptrain.training.batch import BatchError, check_batch

    s, b = 6, 2
    good = collate([(np.array([3, EOD, 4, 5, 6, 7, 8]), np.ones(7, bool))] * b, eod=EOD, reset_attention_mask=True,
                   create_attention_mask=False)
    expect = dict(micro_batch_size=b, seq_length=s, vocab_size=10, with_attention_mask=True, source="my.Provider",
                  document_offsets=True)
    check_batch(good, **expect)
    with pytest.raises(BatchError, match=r"cu_seqlens is NoneType, expected \[2, 7\] torch.int64 "
                                         r"\(data.reset_attention_mask=true.*data.create_attention_mask_in_dataloader"):
        check_batch({**good, "cu_seqlens": None}, **expect)
    with pytest.raises(BatchError, match="cu_seqlens rows must start at 0, never decrease and end at s=6"):
        check_batch({**good, "cu_seqlens": good["cu_seqlens"].flip(1)}, **expect)


# --- training: document offsets vs the dense [b, 1, s, s] mask ---------------------------------------------
# mock ids run consecutively mod data.vocab_size from a random start, so with vocab 13 (EOD = 12) every 32-token
# sample holds 2-3 documents, cut at a different place in each sample
DOCS = ["model=tiny", "model.num_layers=2", "model.seq_length=32", "data=mock", "data.vocab_size=13",
        "data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true",
        "train.train_iters=3", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=3",
        "train.eval_iters=1"]


def _kernels(run_dir) -> str:
    return next(line for line in (run_dir / "train.log").read_text().splitlines() if "kernels:" in line)


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """The dense-mask path (data.create_attention_mask_in_dataloader=true) on one process: the reference."""
    from harness import run_distributed
    from train_utils import read_rows, run_job

    run_dir = tmp_path_factory.mktemp("dense") / "run"
    run_distributed(run_job, 1, DOCS + ["parallel=tp1pp1", "data.create_attention_mask_in_dataloader=true",
                                        f"run.dir={run_dir}"])
    assert "attention=dense [b,1,s,s] mask (data.create_attention_mask_in_dataloader=true)" in _kernels(run_dir)
    return {split: read_rows(run_dir, split) for split in ("train", "valid", "test")}


@pytest.mark.parametrize("world,parallel,extra", [
    (1, "tp1pp1", []),
    (1, "tp1pp1", ["model.recompute_granularity=selective"]),  # the core attention replayed in backward
    (2, "tp2pp1", ["parallel.sequence_parallel=true"]),  # cu_seqlens broadcast within TP with the token ids
    (2, "tp1pp2", []),  # every stage reads its micro-batch's documents
])
def test_training_with_document_offsets_equals_the_dense_mask(dense_run, tmp_path, world, parallel, extra):
    from harness import run_distributed
    from train_utils import read_rows, run_job

    run_dir = tmp_path / "run"
    run_distributed(run_job, world, DOCS + [f"parallel={parallel}", f"run.dir={run_dir}", *extra])
    assert "attention=documents (per-document SDPA is_causal, on cpu)" in _kernels(run_dir)
    rows = read_rows(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for want, got in zip(dense_run["train"], rows):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5), (parallel, want["iteration"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (parallel, want["iteration"])
    for split in ("valid", "test"):  # evaluation (forward only) reads the same documents
        got = read_rows(run_dir, split)
        assert [r["iteration"] for r in got] == [r["iteration"] for r in dense_run[split]] and got, split
        for want, row in zip(dense_run[split], got):
            assert row["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5), (parallel, split, want["iteration"])
    if parallel == "tp1pp1" and not extra:  # the documents matter: plain causal attention trains other numbers
        causal = tmp_path / "causal"
        run_distributed(run_job, 1, DOCS + [f"parallel={parallel}", "data.reset_attention_mask=false",
                                            f"run.dir={causal}"])
        assert abs(read_rows(causal)[0]["lm_loss"] - rows[0]["lm_loss"]) > 1e-3
