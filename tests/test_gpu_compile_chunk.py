"""``model.compile_scope=chunk`` on CUDA (marker ``gpu``; skipped without CUDA).

The whole chunk (embedding, layers, final norm, output layer, cross entropy) as one Inductor graph
against the eager chunk of the same seed: the per-token loss and every parameter grad, fp32 (TF32 off)
and bf16, with no graph break. The CPU counterpart is tests/test_bench_compile.py (gloo, tp 1 and 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.groups import build_groups
from mptrain.layers.gpt import build_model_chunks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, make_vocab_size_divisible_by=128)
VOCAB = 1000
# fp32: Inductor's fused reductions (LayerNorm, softmax, cross entropy) sum in another order than
# ATen's: ulp-level, amplified through 2 layers (1e-5 is far below a wrong or skipped op, O(1e-2)).
# bf16: the eager model itself is 1e-2 from fp32; compiled vs eager differ by bf16 roundings of
# fused intermediates kept in fp32 (bf16 vs fp32 noise of order 1e-2 on CUDA).
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def groups():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    g = build_groups(1, 1, device=torch.device("cuda"))
    yield g
    g.destroy()
    dist.destroy_process_group()


def _run(groups, dtype, compile_layers, mode="auto"):
    cfg = ModelConfig(**SHAPE, compile_layers=compile_layers, compile_mode=mode)
    model = build_model_chunks(cfg, ParallelConfig(), groups, vocab_size=VOCAB, seed=3, params_dtype=dtype,
                               device=torch.device("cuda"))[0]
    assert model.compiled_chunk == compile_layers, model.compile_blocker
    assert model.compile_mode == ("reduce-overhead" if compile_layers and mode == "auto" else None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, cfg.seq_length), device="cuda", generator=gen)
    labels = torch.randint(0, VOCAB, (4, cfg.seq_length), device="cuda", generator=gen)
    for _ in range(3):  # later calls run the cached graphs (CUDA graphs: recorded on the 2nd, replayed on the 3rd)
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels)
        loss.float().sum().backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode", ["auto", None])  # auto: CUDA graphs (reduce-overhead) at tp = pp = 1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_equals_eager_on_cuda(groups, dtype, mode, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref_loss, ref_grads = _run(groups, dtype, False)
    got_loss, got_grads = _run(groups, dtype, True, mode)
    assert counters["stats"]["calls_captured"] > 0
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    errors = {"loss": _rel(got_loss, ref_loss), **{n: _rel(got_grads[n], ref_grads[n]) for n in ref_grads}}
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
    assert not bad, bad

