"""Model construction: layout-independent init, tied-embedding sync, layer split, config errors,
parameter counts, fp16/bf16 smoke."""

import pathlib

import pytest
import torch
import yaml

from harness import run_distributed
from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.errors import ConfigError
from mptrain.groups import build_groups
from mptrain.layers.gpt import build_model_chunks, check_model_config, pipeline_layer_ranges
from mptrain.layers.params import count_parameters
from mptrain.layers.sharding import collect_shard_specs, gather_full_tensor

CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, make_vocab_size_divisible_by=8)


# --- layer split ---------------------------------------------------------------------------------
def test_pipeline_layer_ranges_tables():
    assert pipeline_layer_ranges(4, 1) == [[[0, 1, 2, 3]]]
    assert pipeline_layer_ranges(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]  # chunk c of rank r = block c·pp + r
    assert pipeline_layer_ranges(8, 4, 2) == [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]
    assert pipeline_layer_ranges(10, 4, None, 1, 3) == [[[0]], [[1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]
    assert pipeline_layer_ranges(6, 2, None, None, 2) == [[[0, 1, 2, 3]], [[4, 5]]]
    assert pipeline_layer_ranges(12, 3, 2, 2, 2) == [[[0], [6]], [[1, 2, 3, 4], [7, 8, 9, 10]], [[5], [11]]]


# --- config errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("model, parallel, keys", [
    (dict(num_attention_heads=6, hidden_size=48), dict(tensor_model_parallel_size=4), "num_attention_heads=6.*tensor_model_parallel_size=4"),
    (dict(hidden_size=30), {}, "hidden_size=30.*num_attention_heads=4"),
    (dict(num_layers=6), dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), "num_layers=6.*pipeline_model_parallel_size × virtual_pipeline_model_parallel_size = 2 × 2"),
    (dict(num_query_groups=3), {}, "num_attention_heads=4.*num_query_groups=3"),
    (dict(num_attention_heads=8, num_query_groups=2), dict(tensor_model_parallel_size=4), "num_query_groups=2.*tensor_model_parallel_size=4"),
    (dict(ffn_hidden_size=66), dict(tensor_model_parallel_size=4), "ffn_hidden_size=66"),
    (dict(normalization="BatchNorm"), {}, "model.normalization: unknown option 'BatchNorm'"),
    (dict(activation="relu"), {}, "model.activation: unknown option 'relu'"),
    (dict(recompute_granularity="some"), {}, "model.recompute_granularity: unknown option 'some'"),
    (dict(recompute_granularity="full", recompute_method="every"), {}, "model.recompute_method: unknown option 'every'"),
    (dict(seq_length=18), dict(tensor_model_parallel_size=4, sequence_parallel=True), "seq_length=18"),
    (dict(num_layers=5), dict(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1), "decoder_first_pipeline_num_layers"),
])
def test_bad_configs_raise_one_line_naming_the_keys(model, parallel, keys):
    with pytest.raises(ConfigError, match=keys) as info:
        check_model_config(ModelConfig(**{**dict(hidden_size=64), **model}), ParallelConfig(**parallel))
    assert "\n" not in str(info.value)


# --- parameter counts ----------------------------------------------------------------------------
def _model_yaml(name):
    with open(pathlib.Path(__file__).resolve().parents[1] / "conf" / "model" / f"{name}.yaml") as f:
        data = yaml.safe_load(f)
    data.pop("defaults", None)
    return ModelConfig(**data)


def test_design_document_count_for_seed_2_8b():
    cfg = _model_yaml("seed_2.8b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (12, 4096, 8, 50257)
    assert count_parameters(cfg, vocab_size=50257, convention="design_doc") == 2_827_821_056


@pytest.mark.parametrize("name, layers, hidden, heads, seq", [
    ("tiny", 4, 64, 4, 64), ("gpt_125m", 12, 768, 12, 2048), ("gpt_350m", 24, 1024, 16, 2048),
    ("gpt_1.3b", 24, 2048, 16, 2048), ("gpt_2.7b", 32, 2560, 32, 2048), ("gpt_6.7b", 32, 4096, 32, 2048),
    ("gpt_13b", 40, 5120, 40, 2048), ("seed_2.8b", 12, 4096, 8, 1024)])
def test_model_presets_match_design_table(name, layers, hidden, heads, seq):
    cfg = _model_yaml(name)
    assert (cfg.name, cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length) == (name, layers, hidden, heads, seq)
    check_model_config(cfg, ParallelConfig())


def _real_count(rank, world, tp, pp, over):
    g = build_groups(tp, pp)
    try:
        cfg = ModelConfig(**{**CFG, **over})
        chunks = build_model_chunks(cfg, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                                    g, vocab_size=50, seed=1)
        n = 0
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            for name, spec in collect_shard_specs(chunk).items():
                if spec.is_shared_copy or (spec.partition_dim is None and g.tp_rank != 0):
                    continue  # counted once: replicated over TP on tp rank 0; tied copy on the first stage
                p = params[name]
                n += p.numel() if spec.valid is None else p.numel() // p.shape[spec.partition_dim] * spec.valid
        return n
    finally:
        g.destroy()


@pytest.mark.parametrize("tp, pp, over", [
    (1, 1, {}), (2, 1, {}), (2, 2, {}), (1, 4, dict(untie_embeddings_and_output_weights=True)),
    (2, 2, dict(num_query_groups=2, activation="swiglu", normalization="RMSNorm", position_embedding_type="rope",
                add_bias_linear=False)),
    (1, 2, dict(num_moe_experts=3, moe_layer_freq=2, moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, add_bias_linear=False)),
])
def test_real_count_equals_built_model(tp, pp, over):
    total = sum(run_distributed(_real_count, tp * pp, tp, pp, over))
    assert total == count_parameters(ModelConfig(**{**CFG, **over}), vocab_size=50)


# --- layout-independent init + tied sync -------------------------------------------------------------
def _full_weights(groups, cfg, tp, pp, vpp=None):
    par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         virtual_pipeline_model_parallel_size=vpp)
    out = {}
    for chunk in build_model_chunks(cfg, par, groups, vocab_size=50, seed=9):
        params = dict(chunk.named_parameters())
        for name, spec in collect_shard_specs(chunk).items():
            out[name] = gather_full_tensor(params[name].detach(), spec, groups.tp_group)
    return out


def _layout_init(rank, world, tp, pp, vpp, over):
    cfg = ModelConfig(**{**CFG, **over})
    g1 = build_groups(1, 1)
    try:
        ref = _full_weights(g1, cfg, 1, 1)
    finally:
        g1.destroy()
    g = build_groups(tp, pp, vpp)
    try:
        got = _full_weights(g, cfg, tp, pp, vpp)
        stage = g.pp_rank
    finally:
        g.destroy()
    tied_copy = "output_layer.weight" in got and "output_layer.weight" not in ref
    for name, full in got.items():
        ref_name = "embedding.word_embeddings.weight" if (name == "output_layer.weight" and tied_copy) else name
        assert torch.equal(full, ref[ref_name]), (name, stage)
    return sorted(got), tied_copy


@pytest.mark.parametrize("tp, pp, vpp, over", [
    (2, 2, None, {}),
    (2, 2, None, dict(untie_embeddings_and_output_weights=True, activation="swiglu", num_query_groups=2)),
    (1, 2, 2, {}),
])
def test_init_is_layout_independent_and_tied_embedding_synced(tp, pp, vpp, over):
    res = run_distributed(_layout_init, tp * pp, tp, pp, vpp, over)
    names = set().union(*(set(n) for n, _ in res))
    assert any(n.startswith("decoder.layers.3.") for n in names) and "decoder.final_layernorm.weight" in names
    tied = not over.get("untie_embeddings_and_output_weights", False)
    last = [copy for r, (_, copy) in enumerate(res) if r >= len(res) - tp]
    assert all(last) == tied  # the last stage holds a synced copy of the tied embedding (== tp1's embedding)


# --- fp16 / bf16 on CPU ------------------------------------------------------------------------------------
def _precision(rank, world):
    g = build_groups(2, 1)
    try:
        gen = torch.Generator().manual_seed(4)
        ids, labels = torch.randint(0, 50, (2, 16), generator=gen), torch.randint(0, 50, (2, 16), generator=gen)
        out = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for dropout in (0.0, 0.1):
                cfg = ModelConfig(**CFG, attention_dropout=dropout)
                model = build_model_chunks(cfg, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), g,
                                           vocab_size=50, seed=4, params_dtype=dtype)[0]
                loss = model(ids, labels=labels)
                loss.mean().backward()
                grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
                out[(str(dtype), dropout)] = (loss.dtype, float(loss.mean()), grads_finite)
        return out
    finally:
        g.destroy()


def test_fp16_bf16_forward_backward_on_cpu():
    out = run_distributed(_precision, 2)[0]
    for (dtype, dropout), (loss_dtype, loss, finite) in out.items():
        assert loss_dtype == torch.float32 and finite, (dtype, dropout)
        # half precision at init: loss ≈ ln 50 ≈ 3.9; bf16 has ~3 significant digits, so 2% relative
        # covers rounding of activations through 4 layers while catching a broken path (O(1) off).
        ref = out[("torch.float32", dropout)][1]
        assert abs(loss - ref) <= 0.02 * ref, (dtype, dropout, loss, ref)
