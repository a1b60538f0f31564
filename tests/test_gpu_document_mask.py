"""Document masking on CUDA (marker ``gpu``; skipped without CUDA): FlexAttention's block-mask path.

- `document_attention`'s flex backend (compiled) equals the per-document SDPA reference, output and
  q / k / v grads, on a sequence of uneven documents.
- A compiled model chunk (``model.compile_layers`` on by default for CUDA) attending with a `DocumentMask`
  gives each document's logits as running it alone, and a second micro-batch with other documents runs
  the same graphs (no recompilation per micro-batch).
"""

from __future__ import annotations

import pytest
import torch

from mptrain.layers.document_mask import DocumentMask, document_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cu(lengths: list, s: int, b: int = 1) -> torch.Tensor:
    row = torch.full((s + 1,), s, dtype=torch.int64)
    row[0] = 0
    row[1:len(lengths)] = torch.tensor(lengths[:-1]).cumsum(0)
    return row.expand(b, -1).contiguous().cuda()


def test_flex_equals_each_document_alone_forward_and_backward():
    torch.manual_seed(0)
    s = 1024
    mask = DocumentMask(_cu([300, 1, 200, 523], s, b=2))
    q, k, v = (torch.randn(2, 4, s, 64, device="cuda", requires_grad=True) for _ in range(3))
    g = torch.randn(2, 4, s, 64, device="cuda")
    got = {}
    for backend in ("flex", "per_document"):
        mask.prepare(backend)
        out = document_attention(q, k, v, mask, backend=backend)
        out.backward(g)
        got[backend] = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    for name, a, b in zip(("out", "dq", "dk", "dv"), got["flex"], got["per_document"]):
        assert (a - b).abs().max().item() <= 2e-4, name


def test_compiled_chunk_with_documents_equals_each_document_alone_without_recompiling():
    from mptrain.checkpoint.offline import single_rank_groups
    from mptrain.config.model import ModelConfig
    from mptrain.config.parallel import ParallelConfig
    from mptrain.layers.gpt import build_model_chunks

    s = 256
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=2, seq_length=s, hidden_dropout=0.0,
                      attention_dropout=0.0)
    model = build_model_chunks(cfg, ParallelConfig(), single_rank_groups(), vocab_size=64, seed=3,
                               device=torch.device("cuda"))[0].eval()
    assert model.compile_plan.compile_layers
    tokens = torch.randint(0, 64, (1, s), device="cuda")
    positions = torch.arange(s, device="cuda")[None]
    masks = [_cu([100, 156], s), _cu([30, 200, 26], s)]
    with torch.no_grad():
        # cloned: at tp = pp = 1 the chunk replays a CUDA graph, whose next run overwrites its output buffer
        first = model(tokens, positions, DocumentMask(masks[0])).clone()
        with torch._dynamo.config.patch(error_on_recompile=True):  # other documents, the same graphs
            second = model(tokens, positions, DocumentMask(masks[1])).clone()
        for cu, logits in zip(masks, (first, second)):
            row = cu[0].tolist()
            for a, z in zip(row[:-1], row[1:]):
                if z > a:
                    alone = model(tokens[:, a:z], positions[:, a:z])  # plain causal over the document
                    assert (logits[0, a:z] - alone[0]).abs().max().item() <= 1e-3, (row, a, z)
