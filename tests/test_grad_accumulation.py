"""parallel.gradient_accumulation_fusion: weight grads accumulate into main_grad from the GEMM.

The tiny GPT wrapped in DDP with the fusion on vs off, two micro-batches accumulated (gloo, CPU):
the grad buffers are equal (the tied embedding's too: the output layer accumulates its part, the
lookup's part comes through the hook) (fp32: the GEMM's β = 1 epilogue vs mm + add, to rounding; bf16 params
with fp32 main grads: CPU's fallback is the unfused arithmetic, so bitwise), no linear weight ever
holds a ``.grad``, and with ``overlap_grad_reduce`` every bucket is launched from backward, so the
fused path reports readiness (a bucket holding only linear weights would otherwise wait for
``finish_grad_sync``). Also at tp 2 with sequence parallelism and the async input-grad path, and there under
``model.compile_layers`` (the op runs in place inside the compiled backward; compared with the eager hook;
suite time: one compile per case, none at tp 1, whose linears are the same op without the TP collectives).
That compiled case is also the suite's Inductor compile of the tp 2 sequence-parallel chunk
(tests/test_bench_compile.py's module docstring): its per-token losses equal eager's, something was compiled,
and no in-place c10d collective was traced (tests/compile_checks.py).
The K-major variant under compile is traced by ``aot_eager`` (on CPU its copy is ``Xᵀ.contiguous()`` before
the same op: what it adds to the Inductor-compiled case is the traced graph, not new code generation).
"""

from __future__ import annotations


import pytest
import torch

from compile_checks import record_traced_collectives
from harness import run_distributed
from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.distributed import DistributedDataParallel
from mptrain.groups import build_groups
from mptrain.layers import grad_accumulation
from mptrain.layers.gpt import build_model_chunks
from mptrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mptrain.precision.module import Float16Module
from procs import run_python

VOCAB, SEQ, MBS = 64, 16, 2


def _buffers(rank, world, tp, fused, *, compile_layers=False, sp=False, bf16=False, kmajor=False, backend=None):
    """``backend``: the compiled chunk's ``torch.compile`` backend (None: Inductor, as the trainer compiles)."""
    groups = build_groups(tp, 1)
    counters = torch._dynamo.utils.counters
    breaks_before = sum(counters["graph_break"].values())  # the worker outlives this task
    captured_before = counters["stats"]["calls_captured"]
    traced = []
    saved = grad_accumulation.tf32_kmajor_pays
    if kmajor:  # the CUDA-TF32-only path, on CPU
        grad_accumulation.tf32_kmajor_pays = lambda t: True
    if compile_layers:
        torch._dynamo.reset()  # graphs are cached by code object: no reuse across kmajor on / off
    try:
        # one layer: the compiled chunk unrolls every layer (suite time), and one layer has every kind of linear
        cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                          make_vocab_size_divisible_by=16, hidden_dropout=0.0, attention_dropout=0.0,
                          compile_layers=compile_layers)
        chunk, = build_model_chunks(cfg, ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp), groups,
                                    vocab_size=VOCAB, seed=3)
        if compile_layers and backend is not None:
            chunk.compile(backend=backend)  # in place of apply_compile's Inductor graph
        module = Float16Module(chunk, torch.bfloat16, is_first_stage=True, is_last_stage=True) if bf16 else chunk
        # bucket_size 3000: several buckets, some holding only linear weights
        ddp = DistributedDataParallel(module, groups, grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                      bucket_size=3000, use_distributed_optimizer=False,
                                      gradient_accumulation_fusion=fused)
        linears = [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        linears.append(chunk.output_layer)  # multiplies by the tied embedding weight (tp1pp1)
        g = torch.Generator().manual_seed(7)
        launched, grads_seen, losses = [], set(), []
        for micro in range(2):
            tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
            labels = torch.roll(tokens, -1, dims=1)
            positions = torch.arange(SEQ).expand(MBS, SEQ)
            with ddp.no_sync() if micro == 0 else torch.enable_grad(), record_traced_collectives(traced):
                loss = ddp(tokens, positions, None, labels=labels)  # [b, s]
                loss.sum().backward()
            losses.append(loss.detach())
            grads_seen |= {i for i, m in enumerate(linears[:-1]) if m.weight.grad is not None}
            if chunk.output_weight().grad is not None:
                grads_seen.add("tied embedding")
            launched.append(ddp.launched_buckets())
        n_buckets = len(ddp.grad_buffers[0].buckets)
        tied = ddp.grad_buffers[0].slot(chunk.output_weight())
        data = ddp.grad_buffers[0].data.clone()
        ddp.finish_grad_sync()
        breaks = sum(counters["graph_break"].values()) - breaks_before
        return {"data": data, "launched": launched, "n_buckets": n_buckets, "grads_seen": sorted(grads_seen), "breaks": breaks,
                "loss": torch.stack(losses), "captured": counters["stats"]["calls_captured"] - captured_before,
                "traced": sorted(set(traced)),
                "tied": (tied.start, tied.end),
                "handed_out": sum(m.weight_main_grad is not None for m in linears), "n_linears": len(linears)}
    finally:
        grad_accumulation.tf32_kmajor_pays = saved
        groups.destroy()


def _check(fused, plain, exact):
    assert fused["n_buckets"] >= 3
    assert fused["handed_out"] == fused["n_linears"] == 5 and plain["handed_out"] == 0
    for r in (fused, plain):
        assert r["grads_seen"] == []  # fused: never a weight .grad; plain: the hook dropped it
        # nothing launched under no_sync; every bucket launched by the last micro-batch's backward
        assert r["launched"] == [[], [(0, b) for b in range(r["n_buckets"])]]
    if exact:
        # except the tied embedding: its output-layer part is now added to main_grad in fp32 before
        # the lookup's part, where autograd used to sum both in bf16 first (bf16 rounding, 1.6e-2 of 11.6)
        lo, hi = fused["tied"]
        keep = torch.ones_like(fused["data"], dtype=torch.bool)
        keep[lo:hi] = False
        assert torch.equal(fused["data"][keep], plain["data"][keep])
        torch.testing.assert_close(fused["data"][lo:hi], plain["data"][lo:hi], rtol=0, atol=2e-2)
        assert not torch.equal(fused["data"][lo:hi], plain["data"][lo:hi])
    else:
        torch.testing.assert_close(fused["data"], plain["data"], rtol=1e-5, atol=1e-6)
    assert fused["data"].abs().sum() > 0
    assert fused["breaks"] == 0  # compile_layers: the custom op traces without a graph break
    assert fused["traced"] == []  # no in-place c10d collective inside a compiled graph (tests/compile_checks.py)
    # fp32 per-token losses [2 micro-batches, b, s]; compiled: Inductor's fused reductions, a few ulps
    # (tests/test_bench_compile.py's REL); bf16 params: the same ops in the same order
    torch.testing.assert_close(fused["loss"], plain["loss"], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


def test_fused_accumulation_equals_hook_tp1():
    fused, = run_distributed(_buffers, 1, 1, True)
    plain, = run_distributed(_buffers, 1, 1, False)
    _check(fused, plain, exact=False)


def test_fused_accumulation_bf16_params_fp32_main_grad():
    fused, = run_distributed(_buffers, 1, 1, True, bf16=True)
    plain, = run_distributed(_buffers, 1, 1, False, bf16=True)
    _check(fused, plain, exact=True)  # CPU: bf16 product then fp32 add, as the hook does


@pytest.fixture(scope="module")
def tp2_buffers():
    """`_buffers` at tp 2 (``fused``, sp, compile_layers) -> results by rank, each case run once per
    module: the K-major test's plain (non-K-major) runs are three of test_fused_accumulation_tp2's
    runs (suite time: one compiled tp-2 run fewer)."""
    memo = {}

    def get(fused, sp, compile_layers):
        key = (fused, sp, compile_layers)
        if key not in memo:
            memo[key] = run_distributed(_buffers, 2, 2, fused, sp=sp, compile_layers=compile_layers)
        return memo[key]

    return get


@pytest.mark.parametrize("sp, compile_layers", [(False, False), (True, False), (True, True)])
def test_fused_accumulation_tp2(tp2_buffers, sp, compile_layers):
    fused = tp2_buffers(True, sp, compile_layers)
    plain = tp2_buffers(False, sp, False)  # the eager hook is the reference of the compiled fused path too
    for f, p in zip(fused, plain):
        _check(f, p, exact=False)
        assert (f["captured"] > 0) == compile_layers  # compiled: the chunk went through torch.compile


@pytest.mark.parametrize("fused, compile_layers", [(True, False), (False, False), (True, True)])
def test_kmajor_weight_grad_equals_plain(tp2_buffers, fused, compile_layers):
    """The K-major Xᵀ copies of `grad_accumulation.tf32_kmajor_pays` (forced on CPU): same grads, fused into main_grad
    or returned. With SP the column-parallel layers take `transpose.transpose_copy` (its CPU
    fallback here), the row-parallel ones ``.contiguous()``; under compile those are in the traced backward
    (``aot_eager``, module docstring), compared with the Inductor-compiled plain run.
    """
    kmajor = run_distributed(_buffers, 2, 2, fused, sp=True, compile_layers=compile_layers, kmajor=True,
                             backend="aot_eager" if compile_layers else None)
    plain = tp2_buffers(fused, True, compile_layers)
    for k, p in zip(kmajor, plain):
        torch.testing.assert_close(k["data"], p["data"], rtol=1e-5, atol=1e-6)
        assert k["grads_seen"] == [] and k["breaks"] == 0 and k["data"].abs().sum() > 0
        assert k["handed_out"] == (5 if fused else 0)


def test_tf32_matmul_enabled_reads_both_apis():
    """TF32 set through the legacy ``allow_tf32`` or the newer ``fp32_precision`` API (the legacy read
    raises after the new API was used): the K-major decision sees both. Own process: global state."""
    code = (
        "import torch\n"
        "from mptrain.layers.grad_accumulation import _tf32_matmul_enabled as on\n"
        "out = [on()]\n"
        "torch.backends.cuda.matmul.allow_tf32 = True; out.append(on())\n"
        "torch.backends.cuda.matmul.allow_tf32 = False; out.append(on())\n"
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'; out.append(on())\n"
        "torch.backends.cuda.matmul.fp32_precision = 'ieee'; out.append(on())\n"
        "torch.backends.cuda.matmul.fp32_precision = 'none'; torch.backends.fp32_precision = 'tf32'; out.append(on())\n"
        "print(out)\n"
    )
    result = run_python(["-c", code], timeout=120)  # a child forked from a process that only imported torch + mptrain
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[False, True, False, True, False, True]"
