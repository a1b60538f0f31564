"""Pipeline schedules with the tiny GPT (layers/gpt.py): every schedule and layout equals no_pipelining at tp1pp1.

Each case runs one forward/backward over a global batch of m micro-batches, rescales the grads by
``max_tokens / num_tokens`` (what finalize_model_grads does) and compares every parameter, as a
full unpadded tensor rebuilt from the shards, with the pp = 1 reference on the same batch. The
tied embedding is compared as the sum of the first stage's embedding grad and the last stage's
output-layer copy (the embedding-group all-reduce belongs to finalize_model_grads).
"""

import functools

import pytest
import torch

from harness import run_distributed
from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.errors import ConfigError
from mptrain.groups import build_groups
from mptrain.layers.gpt import build_model_chunks
from mptrain.layers.sharding import collect_shard_specs, place_shard
from mptrain.schedules import ScheduleStats
from schedule_utils import make_spec, schedule_fn

VOCAB, SEQ, MBS, HIDDEN, LAYERS = 101, 16, 2, 32, 8


def model_cfg():
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                       vocab_size=VOCAB, make_vocab_size_divisible_by=16)


def make_batches(m, seed=11):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        out.append({
            "tokens": tokens,
            "labels": torch.roll(tokens, -1, dims=1),
            "loss_mask": (torch.rand(MBS, SEQ, generator=g) < 0.75).float(),  # uneven token counts per micro-batch
            "position_ids": torch.arange(SEQ).expand(MBS, SEQ),
        })
    return out


def forward_step(data_iterator, chunk):
    batch = next(data_iterator)  # one iterator per chunk, consumed in micro-batch order
    out = chunk(batch["tokens"] if chunk.pre_process else None, batch["position_ids"] if chunk.pre_process else None,
                None, labels=batch["labels"] if chunk.post_process else None)

    def loss_func(per_token):
        loss_sum = (per_token * batch["loss_mask"]).sum()
        num_tokens = batch["loss_mask"].sum()
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach(), "num_tokens": num_tokens.detach()}

    return out, loss_func


def _run(rank, world, tp, pp, vpp, schedule, m, sequence_parallel=False):
    """One forward/backward; returns per-rank (coords, {name: (spec, grad)}, loss pieces, stats)."""
    groups = build_groups(tp, pp, vpp)
    try:
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sequence_parallel)
        chunks = build_model_chunks(model_cfg(), parallel, groups, vocab_size=VOCAB, seed=5)
        max_tokens = m * MBS * SEQ  # of the global batch
        m_local = m // groups.dp_size  # each DP rank runs its contiguous share of the global batch
        batches = make_batches(m)[groups.dp_rank * m_local:(groups.dp_rank + 1) * m_local]
        iters = [iter(batches) for _ in chunks]
        stats = ScheduleStats()
        try:
            spec = make_spec(groups, num_microbatches=m_local, seq_length=SEQ, micro_batch_size=MBS, hidden_size=HIDDEN,
                             sequence_parallel=sequence_parallel, max_tokens=max_tokens)
            reports, num_tokens = schedule_fn(schedule)(
                spec, forward_step_func=forward_step, data_iterator=iters if vpp else iters[0], model=chunks, stats=stats)
        except ConfigError as e:
            return {"error": str(e)}
        grads = {}
        for chunk in chunks:
            specs = collect_shard_specs(chunk)
            for name, p in chunk.named_parameters():
                grads[name] = (specs[name], p.grad.detach().clone())
        loss = None
        if groups.is_last_stage:
            loss = (float(sum(r["loss_sum"] for r in reports)), float(sum(r["num_tokens"] for r in reports)))
            assert int(num_tokens) == int(sum(b["loss_mask"].sum() for b in batches))
        return {"tp": groups.tp_rank, "pp": groups.pp_rank, "dp": groups.dp_rank, "grads": grads, "loss": loss, "max_tokens": max_tokens,
                "inflight": stats.max_inflight_microbatches}
    finally:
        groups.destroy()


def full_grads(results, sequence_parallel=False):
    """Rebuild full unpadded grads from every rank's shards: TP shards placed, the shared copy and DP ranks added."""
    full = {}
    for res in results:
        for name, (spec, grad) in res["grads"].items():
            target = "embedding.word_embeddings.weight" if spec.is_shared_copy else name
            piece = torch.zeros(spec.global_shape)
            place_shard(piece, grad, spec)
            if spec.partition_dim is None and res["tp"] != 0 and not (sequence_parallel and spec.sequence_parallel_grad):
                # TP-replicated, no SP: every TP rank holds the same complete grad; count it once
                torch.testing.assert_close(piece, full[target + f"@pp{res['pp']}dp{res.get('dp', 0)}"], rtol=0, atol=0)
                continue
            if spec.partition_dim is None and res["tp"] == 0:
                full[target + f"@pp{res['pp']}dp{res.get('dp', 0)}"] = piece.clone()
            full[target] = full.get(target, 0) + piece
    return {k: v for k, v in full.items() if "@" not in k}


@functools.lru_cache(maxsize=None)
def reference(m):
    """no_pipelining at tp1pp1 on the same global batch (world of 1)."""
    res = run_distributed(_run, 1, 1, 1, None, "no_pipelining", m)[0]
    return full_grads([res]), res["loss"]


def check_against_reference(results, m, sequence_parallel=False):
    ref_grads, (ref_sum, ref_tokens) = reference(m)
    scale = results[0]["max_tokens"] / ref_tokens  # finalize_model_grads' rescale (same for both runs)
    got = full_grads(results, sequence_parallel)
    assert sorted(got) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        # fp32, different reduction orders (micro-batch accumulation, TP partial sums): rel 1e-5 of the
        # tensor's largest entry (required: rel 1e-5)
        torch.testing.assert_close(got[name] * scale, ref * scale, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                                   msg=lambda s, n=name: f"{n}: {s}")
    last = [r for r in results if r["loss"] is not None]  # last stage: every (tp, dp) rank reports
    per_dp = {r["dp"]: r["loss"] for r in last if r["tp"] == 0}
    assert all(r["loss"] == per_dp[r["dp"]] for r in last)  # TP ranks agree exactly (vocab-parallel CE)
    loss_sum, tokens = sum(v[0] for v in per_dp.values()), sum(v[1] for v in per_dp.values())
    assert tokens == ref_tokens
    assert loss_sum / tokens == pytest.approx(ref_sum / ref_tokens, rel=1e-5)  # fp32, other summation order


# the GPT chunks through each schedule with fewer, as many and more micro-batches than stages; every count
# (1, 2, 3, 4, 8 at pp2 and pp4; interleaved 2, 4, 8 / 4, 8) on the same schedule code: tests/test_schedules.py
# (test_pp2, test_pp4, test_interleaved_pp2_vpp2, test_interleaved_pp4_vpp2), a toy chunk against its reference
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_gpt_pp2(schedule, m):
    results = run_distributed(_run, 2, 1, 2, None, schedule, m)
    check_against_reference(results, m)
    assert [r["inflight"] for r in results] == ([m, m] if schedule == "gpipe" else [min(2, m), 1])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gpt_pp4(schedule, m):
    results = run_distributed(_run, 4, 1, 4, None, schedule, m)
    check_against_reference(results, m)
    assert [r["inflight"] for r in results] == ([m] * 4 if schedule == "gpipe" else [min(4 - r, m) for r in range(4)])


# m % pp != 0 is refused (m = 3 at pp2, 2 at pp4)
@pytest.mark.parametrize("world, m", [(2, 2), (2, 3), (2, 8), (4, 2), (4, 4), (4, 8)])
def test_gpt_interleaved_vpp2(world, m):
    results = run_distributed(_run, world, 1, world, 2, "interleaved_1f1b", m)
    if m % world:
        # the one copy of the rule (interleaved's check_layout; validate_config raises the same line at start-up)
        expected = (f"schedule=interleaved_1f1b needs num_microbatches % pipeline_model_parallel_size == 0, got {m} "
                    f"micro-batches (train.global_batch_size={m * MBS} / (micro_batch_size {MBS} × dp 1)) and "
                    f"pp={world}; make global_batch_size a multiple of {MBS * world}")
        assert [r.get("error") for r in results] == [expected] * world  # rejected on every rank, one line
    else:
        check_against_reference(results, m)


@pytest.mark.parametrize("schedule, vpp", [("1f1b", None), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_tp2_pp2(schedule, vpp, sequence_parallel):
    # sequence parallelism changes the exchanged shape to [s/tp, b, h]
    results = run_distributed(_run, 4, 2, 2, vpp, schedule, 4, sequence_parallel)
    check_against_reference(results, 4, sequence_parallel)


@pytest.mark.parametrize("schedule, vpp", [("1f1b", None), ("gpipe", None), ("interleaved_1f1b", 2)])
def test_gpt_tp2_pp2_dp2_world8(schedule, vpp):
    # the full 3-D layout (8 gloo processes); DP's grad all-reduce is done here by summing
    results = run_distributed(_run, 8, 2, 2, vpp, schedule, 4, True)
    check_against_reference(results, 4, sequence_parallel=True)
