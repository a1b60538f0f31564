"""The planner's context parallelism: cp in the layout search, activations per rank divided by cp, ring bytes."""

import dataclasses

import pytest

from mptrain.planner.config import compose_plan


def _plan(overrides):
    from mptrain.plan import plan_from_config

    return plan_from_config(compose_plan(overrides))[1]


def _cfg(overrides):
    from omegaconf import OmegaConf

    from mptrain.config.schema import as_config

    return as_config(OmegaConf.to_object(compose_plan(overrides)))


def test_cp_is_tried_for_long_sequences_only():
    from mptrain.planner.layouts import cp_options

    assert cp_options(_cfg(["model=gpt_6.7b", "model.seq_length=65536", "model.max_position_embeddings=null"]), 16) \
        == [1, 2, 4, 8, 16]
    assert cp_options(_cfg(["model=gpt_6.7b"]), 16) == [1]  # 2048 tokens: below CP_MIN_TOKENS per rank at cp 2
    assert cp_options(_cfg(["model=gpt_6.7b", "parallel.context_parallel_size=2"]), 16) == [1, 2]  # as configured


def test_a_cp2_layout_holds_half_the_activations_and_sends_the_ring_bytes():
    from mptrain.planner.layouts import ring_bytes_per_layer
    from mptrain.planner.memory import PlanLayout, layer_activation_bytes, logits_bytes

    cfg = _cfg(["model=tiny", "precision=bf16", "model.seq_length=8192"])
    cp1 = PlanLayout(1, 1, None, 2, True, "none", False, "no_pipelining", 2)
    cp2 = dataclasses.replace(cp1, dp=1, cp=2)
    assert layer_activation_bytes(cfg, cp2) == pytest.approx(layer_activation_bytes(cfg, cp1) / 2)
    assert logits_bytes(cfg, cp2, vocab_size=1000, inflight_last=1) == pytest.approx(
        logits_bytes(cfg, cp1, vocab_size=1000, inflight_last=1) / 2)
    # tiny: 4 heads of 16, micro-batch 2 (the tiny defaults): K and V of 4096 tokens
    b = cfg.train.micro_batch_size
    kv = 2 * b * 4096 * 4 * 16
    assert ring_bytes_per_layer(cfg, cp2) == 2 * kv * 2 + 2 * kv * 4  # K/V hop fwd + bwd (bf16), dK/dV twice (fp32)
    assert ring_bytes_per_layer(cfg, cp1) == 0.0


def test_plan_lists_cp_layouts_with_their_ring_traffic():
    records = _plan(["model=tiny", "precision=bf16", "model.seq_length=8192", "world_size=2",
                     "parallel.data_parallel_sharding_strategy=optim_grads_params"])
    cp2 = [r for r in records if r["cp"] == 2]
    assert cp2 and all(r["dp"] == 1 and r["comm_bytes"]["cp"] > 0 for r in cp2)
    assert all(r["comm_bytes"]["cp"] == 0 for r in records if r["cp"] == 1)
    ring, attention = cp2[0]["cp_ring_vs_attention_s"]
    assert ring > 0 and attention > 0
    # ZeRO-3 at cp2 (dp 1) shards over the 2 dp × cp ranks: half of DDP's fp32 grads and Adam state
    one = {r["data_parallel_sharding_strategy"]: r for r in cp2 if (r["tp"], r["recompute"]) == (1, "none")}
    assert set(one) == {"no_shard", "optim", "optim_grads_params"}
    z3, ddp = one["optim_grads_params"]["memory_gib"], one["no_shard"]["memory_gib"]
    assert one["optim_grads_params"]["data_parallel_shard_size"] == 2
    assert z3["grads"] == ddp["grads"] / 2 and z3["optimizer_state"] == ddp["optimizer_state"] / 2
    assert one["optim_grads_params"]["comm_bytes"]["dp"] > 0
