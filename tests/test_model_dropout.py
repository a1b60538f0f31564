"""Dropout RNG regions and activation recomputation."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import run_distributed
from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.groups import build_groups
from mptrain.layers.gpt import GPTModel, build_model_chunks
from mptrain.layers.random import RNGStatesTracker, dropout_slice, init_rng_tracker

CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, make_vocab_size_divisible_by=8)


def _gather(t: torch.Tensor) -> list:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _masks(rank, world):
    """Per layout: (coords, default-stream mask, forked mask, attention-core output, hidden output) of every rank."""
    out = {}
    for tp, pp in ((2, 1), (2, 2)):
        g = build_groups(tp, pp)
        try:
            tracker = init_rng_tracker(5, g)
            default = F.dropout(torch.ones(256), 0.5)
            with tracker.fork():
                forked = F.dropout(torch.ones(256), 0.5)
            cfg = ModelConfig(**CFG, attention_dropout=0.5, hidden_dropout=0.3)
            par = ParallelConfig(tensor_model_parallel_size=tp)
            model = GPTModel(cfg, g, parallel=par, pre_process=True, post_process=False, layer_numbers=[0, 1],
                             vocab_size=50, seed=5, rng_tracker=tracker)
            model.train()
            gen = torch.Generator().manual_seed(1)
            q = torch.randn(16, 2, 2, 8, generator=gen)  # [s, b, np/tp, hn]: identical input on every rank
            core = model.decoder.layers["0"].self_attention.core_attention(q, q[:, :, :2], q[:, :, :2], None)
            ids = torch.randint(0, 50, (2, 16), generator=gen)
            hidden = model(ids)
            model.eval()
            hidden_eval = model(ids)
            out[(tp, pp)] = ([torch.tensor([g.tp_rank, g.dp_rank, g.pp_rank])] + [
                torch.stack(_gather(x)) for x in (default, forked, core.detach(), hidden.detach())],
                bool(torch.equal(hidden, hidden_eval)))
        finally:
            g.destroy()
    return {k: ([v[0][0].tolist()] + v[0][1:], v[1]) for k, v in out.items()}


def test_dropout_masks_differ_inside_tp_regions_and_match_outside():
    res = run_distributed(_masks, 4)
    # tp2 dp2 pp1: ranks 0,1 = tp 0,1 of dp 0; ranks 2,3 = dp 1
    (_, default, forked, core, hidden), same_as_eval = res[0][(2, 1)]
    assert not same_as_eval  # dropout really ran
    for a, b in ((0, 2), (1, 3)):  # DP ranks share every stream
        for t in (default, forked, core, hidden):
            assert torch.equal(t[a], t[b])
    assert torch.equal(default[0], default[1])  # outside TP regions: same mask on TP ranks
    assert torch.equal(hidden[0], hidden[1])  # hidden dropout (replicated activations) matches across TP
    assert not torch.equal(forked[0], forked[1])  # the model-parallel stream differs across TP
    assert not torch.equal(core[0], core[1])  # attention-prob dropout of a head shard differs across TP
    # tp2 pp2: ranks 0,1 = stage 0; ranks 2,3 = stage 1: default streams offset per stage
    (_, default, forked, _, _), _ = res[0][(2, 2)]
    assert torch.equal(default[0], default[1]) and not torch.equal(default[0], default[2])
    assert len({tuple(m.tolist()) for m in forked}) == 4  # every (tp, pp) coordinate has its own stream


def _recompute(rank, world, tp, sequence_parallel):
    g = build_groups(tp, 1)
    results = {}
    try:
        gen = torch.Generator().manual_seed(2)
        ids, labels = torch.randint(0, 60, (2, 16), generator=gen), torch.randint(0, 60, (2, 16), generator=gen)
        modes = {"none": {}, "full_uniform_1": dict(recompute_granularity="full", recompute_method="uniform",
                                                     recompute_num_layers=1),
                 "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
                 "full_block_3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
                 "selective": dict(recompute_granularity="selective")}
        for mode, over in modes.items():
            cfg = ModelConfig(**CFG, attention_dropout=0.2, hidden_dropout=0.2, **over)
            par = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
            model = build_model_chunks(cfg, par, g, vocab_size=60, seed=11)[0]  # re-seeds the streams: same masks
            model.train()
            loss = model(ids, labels=labels)
            loss.sum().backward()
            results[mode] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
            if mode == "none":
                model.eval()
                with torch.no_grad():
                    results["eval"] = model(ids, labels=labels)
    finally:
        g.destroy()
    ref_loss, ref_grads = results["none"]
    assert not torch.equal(ref_loss, results["eval"])  # dropout is active
    for mode in ("full_uniform_1", "full_uniform_2", "full_block_3", "selective"):
        loss, grads = results[mode]
        assert torch.equal(loss, ref_loss), mode
        for name, gr in grads.items():
            assert torch.equal(gr, ref_grads[name]), (mode, name, float((gr - ref_grads[name]).abs().max()))
    return True


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2_sp"])
def test_recomputation_gives_bit_identical_grads(tp, sp):
    assert run_distributed(_recompute, 2, tp, sp) == [True, True]


def test_tracker_state_dict_roundtrip_and_no_nested_fork():
    tracker = RNGStatesTracker(torch.device("cpu"))
    tracker.add("model-parallel-rng", 123)
    state = tracker.state_dict()
    with tracker.fork():
        a = torch.rand(8)
    b = torch.rand(8)
    tracker.load_state_dict(state)
    with tracker.fork():
        assert torch.equal(torch.rand(8), a)
        with pytest.raises(RuntimeError, match="inside fork"):
            with tracker.fork():
                pass
    assert torch.equal(torch.rand(8), b)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 1)


# --- dropout inside the compiled chunk graph ------------------------------------------------------
# aot_eager traces exactly what Inductor gets (Dynamo graph, AOT joint graph) without generating C++;
# the masks then come from ATen's rand on the same generator, in the same order as Inductor's seeds.
COMPILED = dict(CFG, num_layers=1, attention_dropout=0.3, hidden_dropout=0.3, attention_backend="unfused",
                compile_layers=True)


def _compiled_dropout(rank, world):
    """Per layout (tp 1 dp 2; tp 2 with SP): the compiled chunk's training loss (fullgraph: one graph, no
    break), its graph count (after a train step; tp 1: also after an eval pass and another train step),
    a rerun from the restored RNG state and a recomputing chunk (both True when they repeat the loss and
    grads); at tp 2 the compiled attention core's output on identical inputs and sliced masks."""
    from torch._dynamo.testing import CompileCounterWithBackend

    # the pool's worker may have compiled GPTModel._forward for another test's models: their cache entries
    # (shared per code object) would count towards this test's graphs
    torch._dynamo.reset()
    out = {}
    gen = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 60, (2, 16), generator=gen), torch.randint(0, 60, (2, 16), generator=gen)
    q = torch.randn(16, 2, 2, 8, generator=gen)  # [s, b, np/tp, hn]: the same on every rank
    for tp in (1, 2):
        g = build_groups(tp, 1)
        try:
            par = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
            model = build_model_chunks(ModelConfig(**COMPILED), par, g, vocab_size=60, seed=11)[0]
            assert model.compiled_chunk, model.compile_blocker
            counter = CompileCounterWithBackend("aot_eager")
            model.compile(backend=counter, fullgraph=True)  # fullgraph: a graph break raises
            model.train()
            state = model.rng_tracker.state_dict()
            loss = model(ids, labels=labels)
            loss.sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            graphs = [counter.frame_count]
            model.eval()
            with torch.no_grad():
                eval_loss = model(ids, labels=labels) if tp == 1 else None
            model.train()
            model.rng_tracker.load_state_dict(state)  # what a resume restores
            model.zero_grad()
            again = model(ids, labels=labels)
            again.sum().backward()
            graphs.append(counter.frame_count)
            same = torch.equal(again, loss) and all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
            # recomputation inside the graph (tp 1: full, tp 2: selective): the forward's masks, its loss and grads
            recompute = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                         if tp == 1 else dict(recompute_granularity="selective"))
            rc_model = build_model_chunks(ModelConfig(**COMPILED, **recompute), par, g, vocab_size=60, seed=11)[0]
            rc_counter = CompileCounterWithBackend("aot_eager")
            rc_model.compile(backend=rc_counter, fullgraph=True)
            rc_model.train()
            rc_model.rng_tracker.load_state_dict(state)
            rc_loss = rc_model(ids, labels=labels)
            rc_loss.sum().backward()
            same_rc = torch.equal(rc_loss, loss) and rc_counter.frame_count == 1
            for n, p in rc_model.named_parameters():  # fp32, the same ops recomputed: a few ulps at most
                torch.testing.assert_close(p.grad, grads[n], rtol=1e-6, atol=1e-7)
            ctx = masks = None
            if tp > 1:
                core = torch.compile(model.decoder.layers["0"].self_attention.core_attention, backend="aot_eager",
                                     fullgraph=True)
                ctx = torch.stack(_gather(core(q, q[:, :, :2], q[:, :, :2], None).detach()))
                drop = torch.compile(dropout_slice, backend="aot_eager", fullgraph=True)
                masks = torch.stack(_gather(drop(torch.ones(8, 32, 32), 0.3, dim=0, index=g.tp_rank, parts=tp)))
            out[tp] = (loss.detach(), eval_loss, graphs, same and same_rc, ctx, masks)
        finally:
            g.destroy()
    return out


def test_compiled_chunk_draws_dropout_in_one_graph_with_the_tp_semantics():
    res = run_distributed(_compiled_dropout, 2)
    loss, eval_loss, graphs, rerun_same, _, _ = res[0][1]
    assert not torch.equal(loss, eval_loss)  # dropout ran
    # the whole chunk, dropout included, is one graph; evaluation (no_grad, eval mode) adds one, training reuses the first
    assert graphs == [1, 2]
    assert torch.equal(loss, res[1][1][0])  # DP ranks (tp 1, dp 2) draw the same masks
    for rank in (0, 1):
        # the restored generator states give the same masks, loss, grads; so does recomputation (one graph)
        assert res[rank][1][3] and res[rank][2][3]
    assert res[0][2][2] == [1, 1]
    # tp 2 + SP: every rank takes its slice of one mask per site, so the compiled masks do not depend on the layout.
    # fp32, TP-split GEMMs and an all-reduce: a few ulps (rel 1e-5); another mask moves the loss by O(0.1)
    torch.testing.assert_close(res[0][2][0], loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(res[0][2][0], res[1][2][0])  # the loss is complete on every TP rank
    ctx = res[0][2][4]  # the compiled core on identical inputs: its heads' mask differs per TP rank
    assert not torch.equal(ctx[0], ctx[1])
    masks = res[0][2][5]  # each TP rank's slice of one [16, 32, 32] mask, p = 0.3
    assert masks.unique().tolist() == [0.0, pytest.approx(1 / 0.7)]  # dropped, or kept and scaled by 1/(1-p)
    kept = float((masks > 0).float().mean())
    assert abs(kept - 0.7) < 0.02, kept  # 16384 draws: 5 standard deviations (0.0036 each) is 0.018
    assert not torch.equal(masks[0], masks[1])
