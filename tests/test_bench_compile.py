"""`model.compile_layers` (a speed option): the compiled model computes the eager model's function.

Each rank builds the same tiny GPT twice from the same seed (eager, then with every
TransformerLayer's forward through `torch.compile`) and compares the per-token loss and every
weight grad. At tp 2 the TP collectives inside the layer (f / g autograd Functions) are part of
the compiled region and must be the functional collectives: while compiling, no in-place c10d
collective (``dist.all_reduce`` ...) may be traced. On NCCL, Dynamo's rewrite of those gave wrong
weight grads (2 x H200, bench/reports/2026-11-30-compile-tp-correctness.md) where gloo gave right ones, so the
gloo equality alone could not catch it. Skipped where torch.compile cannot build on CPU (no C++
compiler).

Suite time: Inductor's C++ code generation is most of a CPU compile, so each kind of graph is compiled by
Inductor once in the suite: the tp 1 MoE chunk here (embedding, attention, output layer and cross entropy
without TP, the MoE layer); the tp 2 sequence-parallel dense chunk in
tests/test_grad_accumulation.py::test_fused_accumulation_tp2 (the trainer's default linears, whose weight grads
accumulate into the DDP buffer: its loss and every weight's grad against eager, no break, no in-place
collective traced). The layer scope's graphs are traced by ``aot_eager`` (Dynamo's graph and AOTAutograd's
joint forward / backward graphs run by ATen, which is what that case is about: one graph per layer reused by
the next, the f / g all-reduces traced as functional collectives, no break); its cross entropy's passes still
go through Inductor (`mptrain.layers.compile.compile_pass`).
"""

import shutil

import pytest
import torch

from compile_checks import record_traced_collectives
from harness import run_distributed
from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.groups import build_groups
from mptrain.layers.gpt import build_model_chunks

# fp32 on CPU: Inductor fuses LayerNorm / GeLU / residual adds into generated C++ loops whose
# reduction order differs from ATen's, so results differ by a few ulps amplified through two layers
# (observed <= 1e-6 relative); 1e-5 is 10x that and far below a real bug (a wrong or skipped op
# changes the loss by O(1e-2) or more).
REL = 1e-5

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, make_vocab_size_divisible_by=8)
# the MoE layer in place of the MLP: ep 1, dropless, so it is traced with the rest (mptrain.layers.compile.moe_eager_reason)
MOE = dict(num_moe_experts=4, moe_router_topk=2, activation="swiglu", add_bias_linear=False, moe_aux_loss_coeff=0.01)
VOCAB = 100


def _compile_available() -> bool:
    return hasattr(torch, "compile") and (shutil.which("g++") or shutil.which("c++")) is not None


def _loss_and_grads(groups, tp: int, compile_layers: bool, sequence_parallel: bool = False, scope: str = "chunk",
                    moe: bool = False):
    # the chunk graph unrolls every layer: one layer keeps its CPU compile time down (the layer
    # scope's graph is traced once and reused by the second layer, which is what it tests)
    cfg = ModelConfig(**{**BASE, "num_layers": 1 if scope == "chunk" else 2, **(MOE if moe else {})},
                      compile_layers=compile_layers, compile_scope=scope)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    model = build_model_chunks(cfg, parallel, groups, vocab_size=VOCAB, seed=7)[0]
    assert model.compiled_chunk == (compile_layers and scope == "chunk"), model.compile_blocker
    if compile_layers and scope == "layer":  # the layers as apply_compile compiled them, traced by aot_eager (module docstring)
        for layer in model.decoder.layers.values():
            layer.compile(backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, cfg.seq_length), generator=gen)
    labels = torch.randint(0, VOCAB, (2, cfg.seq_length), generator=gen)
    grads = None
    for _ in range(2):  # the second call runs the cached compiled graph (the first one traced it)
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels)  # [b, s] per-token loss
        loss.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(rank, world, tp, sequence_parallel=False, scope="chunk", moe=False):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    g = build_groups(tp, 1)
    traced = []
    try:
        ref_loss, ref_grads = _loss_and_grads(g, tp, False, sequence_parallel, scope, moe)
        with record_traced_collectives(traced):
            got_loss, got_grads = _loss_and_grads(g, tp, True, sequence_parallel, scope, moe)
    finally:
        g.destroy()
    assert set(got_grads) == set(ref_grads)
    errors = {"loss": _rel(got_loss, ref_loss)}
    errors.update({n: _rel(got_grads[n], ref_grads[n]) for n in ref_grads})
    stats = {"captured": counters["stats"]["calls_captured"], "graph_breaks": sum(counters["graph_break"].values()),
             "traced_in_place_collectives": sorted(set(traced))}
    return errors, stats


@pytest.mark.skipif(not _compile_available(), reason="torch.compile needs a C++ compiler on CPU")
# tp 2: the layer graph without sequence parallelism (the f / g all-reduces); suite time: the tp 2 chunk graph
# with it (all-gather / reduce-scatter in the layers, the vocab-parallel cross entropy's all-reduces) is
# tests/test_grad_accumulation.py::test_fused_accumulation_tp2[True-True] (Inductor; the same chunk with the
# trainer's default gradient_accumulation_fusion, compared with eager as here). No dense tp 1 chunk: its dense
# layer is that case's without the collectives, its embedding, attention, output layer and cross entropy are
# compiled at tp 1 by the MoE case.
@pytest.mark.parametrize("tp,sequence_parallel,scope,moe", [(2, False, "layer", False), (1, False, "chunk", True)])
def test_compiled_layers_match_eager(tp, sequence_parallel, scope, moe):
    """compile_scope=chunk: embedding + layers + output + cross entropy as one graph, no graph break; an MoE model
    (ep 1, dropless) too: router, permutation, grouped GEMMs and combine inside the graph."""
    results = run_distributed(_compare, tp, tp, sequence_parallel, scope, moe, timeout_s=900)
    for rank, (errors, stats) in enumerate(results):
        assert stats["captured"] > 0, f"rank {rank}: nothing was compiled ({stats})"
        breaks = stats["graph_breaks"]
        assert breaks == 0, f"rank {rank}: graph breaks in the compiled layer ({stats})"
        assert stats["traced_in_place_collectives"] == [], f"rank {rank}: in-place c10d collectives traced ({stats})"
        bad = {k: v for k, v in errors.items() if not v <= REL}
        assert not bad, f"rank {rank}: compiled vs eager relative errors above {REL}: {bad}"


def test_compile_layers_default_resolves_per_device():
    """null (the default): compiled on CUDA, eager on the CPU; true / false force it."""
    from mptrain.layers.compile import resolve_compile_layers

    config = ModelConfig()
    assert config.compile_layers is None
    assert resolve_compile_layers(config, torch.device("cpu"))[0] is False
    assert resolve_compile_layers(config, torch.device("cuda"))[0] is True
    # recomputation with dropout compiles too (tests/test_gpu_compile_chunk.py checks its masks on CUDA)
    recompute = ModelConfig(recompute_granularity="selective", hidden_dropout=0.1)
    assert resolve_compile_layers(recompute, torch.device("cuda"))[0] is True
    assert resolve_compile_layers(recompute, torch.device("cpu"))[0] is False
    for forced in (True, False):
        config.compile_layers = forced
        assert resolve_compile_layers(config, torch.device("cuda"))[0] is forced
        assert resolve_compile_layers(config, torch.device("cpu"))[0] is forced
