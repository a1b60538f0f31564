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
    compiled = compile_layers is not False  # null (the default): compiled on CUDA
    assert model.compiled_chunk == compiled, model.compile_blocker
    assert model.compile_mode == ("reduce-overhead" if compiled and mode == "auto" else None)
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


@pytest.mark.parametrize("compile_layers, mode", [(True, "auto"), (True, None), (None, "auto")],
                         ids=["auto", "None", "default"])  # auto: CUDA graphs (reduce-overhead) at tp = pp = 1;
# default: the plain command (model.compile_layers=null compiles on CUDA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_equals_eager_on_cuda(groups, dtype, compile_layers, mode, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref_loss, ref_grads = _run(groups, dtype, False)
    got_loss, got_grads = _run(groups, dtype, compile_layers, mode)
    assert counters["stats"]["calls_captured"] > 0
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    errors = {"loss": _rel(got_loss, ref_loss), **{n: _rel(got_grads[n], ref_grads[n]) for n in ref_grads}}
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
    assert not bad, bad



def _dropout_losses(groups, calls):
    """Per-token losses of ``calls`` forward-backward calls of the default (compiled, CUDA-graphed) chunk with
    dropout 0.2 on one input, then the same calls again from the RNG state before the first (a resume)."""
    cfg = ModelConfig(**SHAPE, hidden_dropout=0.2, attention_dropout=0.2)
    model = build_model_chunks(cfg, ParallelConfig(), groups, vocab_size=VOCAB, seed=3, params_dtype=torch.bfloat16,
                               device=torch.device("cuda"))[0]
    assert model.compiled_chunk and model.compile_mode == "reduce-overhead", model.compile_blocker
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, cfg.seq_length), device="cuda", generator=gen)
    labels = torch.randint(0, VOCAB, (4, cfg.seq_length), device="cuda", generator=gen)
    state = model.rng_tracker.state_dict()
    runs = []
    for _ in range(2):
        model.rng_tracker.load_state_dict(state)
        losses = []
        for _ in range(calls):  # warm-up, CUDA-graph recording, replays
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=labels)
            loss.float().sum().backward()
            losses.append(loss.detach().float().clone())
        runs.append(losses)
    model.eval()
    with torch.no_grad():
        eval_loss = model(ids, labels=labels).float()
    return runs, eval_loss


def test_dropout_in_the_cuda_graphed_chunk(groups):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    (first, again), eval_loss = _dropout_losses(groups, 4)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for i in range(1, 4):  # every replay draws new masks
        assert not torch.equal(first[i], first[i - 1]), i
    for a, b in zip(first, again):  # the restored generator state gives the same masks (resume)
        assert torch.equal(a, b)
    assert not torch.equal(first[-1], eval_loss)  # dropout is off in evaluation


def directional_check(model, ids, labels, eps=1e-2):
    """The recomputing model's grad ``g`` of the mean loss, from the generator state before the call, against
    central differences of the loss along ``v = g / |g|``: ``D = (L(θ + εv) - L(θ - εv)) / 2ε``, each forward
    from that same state (the same masks, if the backward replays the forward's), and ``D'`` from another
    state (other masks). Returns ``(|g|, D, D')``: ``D`` equals ``|g|`` when the backward used the forward's
    masks; ``D'`` shows how far another mask moves it."""
    params = [p for p in model.parameters() if p.requires_grad]
    state = model.rng_tracker.state_dict()

    def loss_at(shift, st, dirs=None):
        model.rng_tracker.load_state_dict(st)
        with torch.no_grad():
            for p, d in zip(params, dirs or []):
                p.add_(d, alpha=shift)
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels).float().mean()
        loss.backward()  # every call completes its backward (no pending graph under CUDA graphs)
        with torch.no_grad():
            for p, d in zip(params, dirs or []):
                p.sub_(d, alpha=shift)
        return float(loss.detach())

    loss_at(0.0, state)
    grads = [p.grad.detach().float().clone() for p in params]
    norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
    dirs = [(g / norm).to(p.dtype) for g, p in zip(grads, params)]
    other = model.rng_tracker.state_dict()  # the generator after the calls above: other masks
    d_same = (loss_at(eps, state, dirs) - loss_at(-eps, state, dirs)) / (2 * eps)
    d_other = (loss_at(eps, other, dirs) - loss_at(-eps, other, dirs)) / (2 * eps)
    return norm, d_same, d_other


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="selective"),
                                       dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1)], ids=["selective", "full"])
def test_recomputation_in_the_compiled_chunk_repeats_the_masks(groups, recompute, monkeypatch):
    """fp32 (TF32 off), dropout 0.5, the compiled recomputing chunk: the grad is the derivative of the loss that
    the forward computed, with its masks (`directional_check`: within 1 %), while the same check under other
    masks is off by far more. The recomputing graph draws its masks otherwise than the plain graph (AOTAutograd
    saves and replays the generator state around a recomputed random op), so the plain graph is no reference."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = ModelConfig(**SHAPE, hidden_dropout=0.5, attention_dropout=0.5, compile_layers=True, **recompute)
    model = build_model_chunks(cfg, ParallelConfig(), groups, vocab_size=VOCAB, seed=3,
                               device=torch.device("cuda"))[0]
    assert model.compiled_chunk, model.compile_blocker
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, cfg.seq_length), device="cuda", generator=gen)
    labels = torch.randint(0, VOCAB, (4, cfg.seq_length), device="cuda", generator=gen)
    norm, d_same, d_other = directional_check(model, ids, labels)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert abs(d_same - norm) <= 1e-2 * norm, (norm, d_same, d_other)
    assert abs(d_other - norm) > 1e-1 * norm, (norm, d_same, d_other)  # the check tells masks apart
