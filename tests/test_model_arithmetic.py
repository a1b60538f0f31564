"""Model arithmetic (`mptrain.layers.params`): FLOPs per iteration against torch's FLOP counter, the
trainer's TFLOP/s in metrics.jsonl, and one function behind the trainer, the planner and bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from mptrain.config.model import ModelConfig
from mptrain.layers.params import flops_per_iteration, flops_per_token, layer_params, matmul_weights
from train_utils import run_job

ROOT = Path(__file__).resolve().parents[1]
VOCAB, V_PAD = 100, 128  # make_vocab_size_divisible_by=64: 100 pads to 128
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, make_vocab_size_divisible_by=64,
            attention_backend="unfused")  # unfused: its bmm are counted (CPU flash SDPA has no FLOP formula)
SWIGLU_GQA = dict(activation="swiglu", num_query_groups=2, normalization="RMSNorm", position_embedding_type="rope",
                  ffn_hidden_size=48, add_bias_linear=False)
MODELS = {
    "gpt": {},
    "swiglu_gqa": SWIGLU_GQA,
    # untied output layer, and an attention width np·hn = 48 other than h = 32
    "untied_kv_channels": dict(untie_embeddings_and_output_weights=True, kv_channels=12),
    # an MoE layer then a dense one: the router, k = 2 of 4 experts and the gated shared expert per token
    # (the per-expert loop: torch's FLOP counter does not count torch._grouped_mm)
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=[1, 0],
                moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, moe_grouped_gemm=False,
                activation="swiglu", add_bias_linear=False),
}


def _old_formula(m, v_pad: int) -> int:
    """The per-token count with 12·h² weights per layer: right for plain GPT only (no GQA, SwiGLU, custom widths)."""
    L, h, s = m.num_layers, m.hidden_size, m.seq_length
    return 6 * (12 * L * h * h + v_pad * h) + 12 * L * h * s


def _counted_flops_task(rank: int, world: int, keys: dict, batch: int) -> int:
    """FLOPs `FlopCounterMode` counts in one forward + backward of the loss of a fresh tiny model."""
    from torch.utils.flop_counter import FlopCounterMode

    from mptrain.config.parallel import ParallelConfig
    from mptrain.groups import build_groups
    from mptrain.layers.gpt import build_model_chunks

    groups = build_groups(1, 1, None)
    try:
        cfg = ModelConfig(**{**TINY, **keys})
        model = build_model_chunks(cfg, ParallelConfig(), groups, vocab_size=VOCAB)[0]
        ids = torch.randint(0, VOCAB, (batch, cfg.seq_length))
        positions = torch.arange(cfg.seq_length).unsqueeze(0).expand(batch, -1)
        with FlopCounterMode(display=False) as counter:
            model(ids, positions, labels=ids).sum().backward()
        return int(counter.get_total_flops())
    finally:
        groups.destroy()


@pytest.mark.parametrize("name", list(MODELS))
def test_iteration_flops_equal_torch_flop_counter(name):
    batch = 2
    m = ModelConfig(**{**TINY, **MODELS[name]})
    counted = run_distributed(_counted_flops_task, 1, MODELS[name], batch)[0]
    formula = flops_per_iteration(m, padded_vocab_size=V_PAD, tokens_per_iteration=batch * m.seq_length)
    # every FLOP of the formula is a counted matmul (linears, QKᵀ, P·V, output layer); nothing else is counted
    assert abs(counted - formula) <= 0.01 * formula, (counted, formula)
    if name != "gpt":  # a 12·h² count misses these models by far more than 1 %
        assert abs(counted - _old_formula(m, V_PAD) * batch * m.seq_length) > 0.05 * counted


def test_plain_gpt_keeps_the_megatron_formula_and_recompute_adds_a_layer_forward():
    m = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048)
    assert flops_per_token(m, padded_vocab_size=50304) == _old_formula(m, 50304)
    layers_fwd = 2 * 24 * 12 * 2048**2 + 4 * 24 * 2048 * 2048  # linears + attention core, every layer
    assert flops_per_token(m, padded_vocab_size=50304, recompute="full") == _old_formula(m, 50304) + layers_fwd
    assert flops_per_token(m, padded_vocab_size=50304, recompute="selective") == (
        _old_formula(m, 50304) + 4 * 24 * 2048 * 2048)
    with pytest.raises(ValueError, match="recompute='blocky'"):
        flops_per_token(m, padded_vocab_size=50304, recompute="blocky")
    # SwiGLU + GQA: QKV h·(np + 2·ng)·hn, proj h², fc1 2·h·f, fc2 f·h
    g = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, **SWIGLU_GQA)
    assert matmul_weights(g, padded_vocab_size=V_PAD) == 2 * (32 * 8 * 8 + 32 * 32 + 2 * 32 * 48 + 48 * 32) + 128 * 32
    assert layer_params(g, tp=2) == (32 * 8 * 8 + 32 * 32 + 2 * 32 * 48 + 48 * 32) // 2 + 2 * 32  # + 2 RMSNorms


def test_swiglu_gqa_run_logs_tflops_of_the_formula(tmp_path):
    run_dir = tmp_path / "run"
    keys = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=32",
            "model.make_vocab_size_divisible_by=64", f"model.vocab_size={VOCAB}", f"data.vocab_size={VOCAB}",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.train_iters=2", "train.eval_interval=null",
            f"run.dir={run_dir}"] + [f"model.{k}={v}" for k, v in SWIGLU_GQA.items()]
    run_distributed(run_job, 1, keys)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    assert len(rows) == 2
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, **SWIGLU_GQA)
    per_token = flops_per_token(m, padded_vocab_size=V_PAD)
    for r in rows:
        # one GPU: TFLOP/s = tokens/s × FLOPs per token; both rates divide by the same elapsed time
        assert r["tflops_per_gpu"] == pytest.approx(r["tokens_per_s"] * per_token / 1e12, rel=1e-9)
        assert r["tflops_per_gpu"] != pytest.approx(r["tokens_per_s"] * _old_formula(m, V_PAD) / 1e12, rel=0.05)


def test_planner_and_bench_use_the_same_function():
    from omegaconf import OmegaConf

    from mptrain.planner.config import compose_plan
    from mptrain.planner.layouts import step_flops
    from mptrain.planner.memory import PlanLayout

    sys.path.insert(0, str(ROOT / "bench"))
    import configs as bc

    b = bc.suite("full", 2, ["c_gpt1.3b_bf16_tp1pp2"])[0]  # tp 1, pp 2, global batch 16
    cfg = OmegaConf.to_object(compose_plan(["model=gpt_1.3b", "world_size=2", "train.global_batch_size=16",
                                            "train.micro_batch_size=2"]))
    layout = PlanLayout(1, 2, None, 1, False, "none", False, "1f1b", 8)
    expected = flops_per_iteration(cfg.model, padded_vocab_size=50304, tokens_per_iteration=16 * 2048)
    assert step_flops(cfg, layout, vocab_size=50257) == bc.flops_per_iteration(b) == expected
    assert bc.PEAK_TFLOPS_BF16_DENSE == cfg.hardware.peak_tflops == 989.0


def test_moe_counts_every_expert_and_flops_the_active_ones():
    import yaml

    from mptrain.layers.params import active_parameters, count_parameters

    preset = yaml.safe_load((ROOT / "conf" / "model" / "moe_mixtral_small.yaml").read_text())
    m = ModelConfig(**{k: v for k, v in preset.items() if k != "defaults"})
    h, f = 1024, 3584
    attention = h * (16 + 2 * 8) * 64 + h * h  # QKV (GQA, 8 groups of head dim 64) + proj
    expert = 3 * h * f  # SwiGLU fc1 [2f, h] + fc2 [h, f]
    layer = attention + 8 * h + 2 * h  # + router [8, h] + two RMSNorms
    embeddings = 2 * 32000 * h + h  # untied input and output, final norm
    assert count_parameters(m, vocab_size=32000) == 12 * (layer + 8 * expert) + embeddings == 1_160_373_248
    assert active_parameters(m, vocab_size=32000) == 12 * (layer + 2 * expert) + embeddings == 367_649_792
    per_token = 6 * (12 * (attention + 8 * h + 2 * expert) + 32000 * h) + 12 * 12 * h * 2048
    assert flops_per_token(m, padded_vocab_size=32000) == per_token


@pytest.mark.parametrize("preset, model_type, total, active", [
    ("mixtral_8x7b", "mixtral", 46_702_792_704, 12_879_925_248),
    ("qwen3_30b_a3b", "qwen3_moe", 30_532_122_624, 3_353_032_704)])
def test_moe_presets_count_the_hugging_face_models_parameters(preset, model_type, total, active):
    """The MoE presets' parameter counts equal those of the transformers model their Hugging Face export describes
    (built on the meta device from the family's config.json: no memory), Mixtral 8x7B's 46.7 B and Qwen3-30B-A3B's
    30.5 B; active: the router, 2 of 8 / 8 of 128 experts per token."""
    import yaml

    transformers = pytest.importorskip("transformers")
    from mptrain.hf import registry
    from mptrain.layers.params import active_parameters, count_parameters

    model = {k: v for k, v in yaml.safe_load((ROOT / "conf" / "model" / f"{preset}.yaml").read_text()).items()
             if k != "defaults"}
    m = ModelConfig(**model)
    assert count_parameters(m, vocab_size=m.vocab_size) == total
    assert active_parameters(m, vocab_size=m.vocab_size) == active
    config = transformers.AutoConfig.for_model(**registry()[model_type].config_from_model(model))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in hf.parameters()) == total
