"""Hugging Face MoE checkpoints in and out: Mixtral and Qwen3-MoE (`python -m mptrain.export --import-hf` / `--format hf`).

Tiny random models built by `transformers` (no download), shapes as test_hf_checkpoints.py's (2 layers, hidden 32,
4 query heads in 2 K/V groups, vocab 100) with 4 experts, top-2: Mixtral (every layer MoE, untied); Qwen3-MoE with
norm_topk_prob and layer 1 dense (mlp_only_layers, so moe_layer_freq is a list), head dim 16, query / key norms;
Qwen3-MoE without norm_topk_prob (pre-softmax routing) saved in transformers 5's fused expert layout. Router weights
are drawn large (std 0.5) so that no token's top-k is a near tie that rounding could flip.
Imported, mptrain's logits equal transformers' at tp1, tp2 (sequence parallel, experts split over TP), pp2 and ep2;
greedy decoding equals `generate`; export gives back the Hub's per-expert tensors bit for bit and a config
`AutoModelForCausalLM` loads; training from an import at tp2 equals tp1.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_distributed
from test_hf_checkpoints import (EOS, IDS, PROMPT, TRAIN, VOCAB, _cli, _read_safetensors, _tokenizer_json, _tp1_logits,
                                 hf_reference, import_families)
from train_utils import read_rows, run_job

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=EOS,
              num_experts_per_tok=2, tie_word_embeddings=False)
QWEN3_MOE = dict(COMMON, head_dim=16, moe_intermediate_size=24, num_experts=4, router_aux_loss_coef=0.01)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=4)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **QWEN3_MOE, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe_fused": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **QWEN3_MOE, norm_topk_prob=False)),
}


def _make_hf(family: str, folder) -> torch.nn.Module:
    """Save a random ``family`` model to ``folder`` (and its per-expert form to ``<folder>-hub`` for the fused one);
    returns it in fp32 (eval)."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)  # not the init's ones
            elif name.endswith(".gate.weight"):
                p.normal_(0.0, 0.5)  # the router: well-separated scores
        model.get_output_embeddings().weight[EOS] = 0.0  # EOS never wins: greedy decoding runs its 8 tokens
    fused = family.endswith("_fused")
    model.save_pretrained(folder, save_original_format=not fused)
    if fused:
        model.save_pretrained(f"{folder}-hub")
    _tokenizer_json(folder)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    """`import_families` of the MoE families."""
    return import_families(tmp_path_factory.mktemp("hf_moe"), FAMILIES, _make_hf)


def _layouts_task(rank: int, world: int, ckpt: str, ids: torch.Tensor) -> dict:
    from layout_logits import MOE_LAYOUTS, layout_logits

    return layout_logits(ckpt, ids, MOE_LAYOUTS)


def _generate_task(rank: int, world: int, ckpt: str, prompt: list) -> list:
    from mptrain.generate import generate_ids, load_generator

    gen = load_generator(ckpt)
    try:
        return generate_ids(gen, prompt, max_new_tokens=8)
    finally:
        gen.groups.destroy()


def test_import_records_the_moe_keys(imported):
    from mptrain.checkpoint.offline import atomic_meta

    models = {f: atomic_meta(next(ckpt.glob("iter_*")))["config"]["model"] for f, (_, ckpt, _) in imported.items()}
    moe = ("num_moe_experts", "moe_router_topk", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_pre_softmax",
           "qk_layernorm", "ffn_hidden_size", "moe_aux_loss_coeff")
    assert [models["mixtral"][k] for k in moe] == [4, 2, 1, 48, False, False, 48, 0.001]
    assert [models["qwen3_moe"][k] for k in moe] == [4, 2, [1, 0], 24, False, True, 48, 0.01]
    assert [models["qwen3_moe_fused"][k] for k in moe] == [4, 2, 1, 24, True, True, 48, 0.01]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_decoding_equal_transformers(imported, family):
    _, ckpt, hf = imported[family]
    want, hf_new = hf_reference(hf)
    # fp32, the same math in another summation order: 1e-5 on O(1) logits
    torch.testing.assert_close(_tp1_logits(ckpt, IDS), want, rtol=0, atol=1e-5)
    results = run_distributed(_layouts_task, 2, str(ckpt), IDS)
    for layout in ("tp2pp1", "ep2"):
        for rank in (0, 1):
            torch.testing.assert_close(results[rank][layout], want, rtol=0, atol=1e-5, msg=f"{layout} rank {rank}")
    torch.testing.assert_close(results[1]["tp1pp2"], want, rtol=0, atol=1e-5)  # the last stage holds the logits
    assert run_distributed(_generate_task, 1, str(ckpt), PROMPT)[0] == hf_new and len(hf_new) > 0
    assert run_distributed(_generate_task, 2, str(ckpt), PROMPT) == [hf_new, hf_new]  # tp 2: experts whole per rank


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_after_import_gives_back_the_same_tensors(imported, family, tmp_path):
    hf_dir, ckpt, hf = imported[family]
    assert _cli("--checkpoint", str(ckpt), "--output", str(tmp_path / "out"), "--format", "hf") == 0
    # the Hub's per-expert names, also from a fused folder (the folder save_pretrained writes by default)
    hub = hf_dir.parent / f"{hf_dir.name}-hub" if family.endswith("_fused") else hf_dir
    original, exported = _read_safetensors(hub), _read_safetensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    from mptrain.checkpoint.offline import atomic_meta, model_config_from_dict
    from mptrain.layers.params import count_parameters

    model = atomic_meta(next(ckpt.glob("iter_*")))["config"]["model"]
    assert count_parameters(model_config_from_dict(model), vocab_size=VOCAB) == sum(p.numel() for p in hf.parameters())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__ and config["model_type"] == hf.config.model_type
    for key in ("num_experts_per_tok", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "moe_intermediate_size",
                "intermediate_size", "router_aux_loss_coef", "num_local_experts"):
        assert getattr(back.config, key, None) == getattr(hf.config, key, None), key
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, hf(IDS).logits, rtol=0, atol=0)


def test_training_from_an_import_is_layout_independent(imported, tmp_path):
    """tp2 (sequence parallel: experts and query / key norms over TP, their grads summed) from the imported Qwen3-MoE
    equals tp1pp1 per step (DESIGN.md §3 tolerances)."""
    ckpt = imported["qwen3_moe"][1]
    runs = {}
    for world, parallel in ((1, ["parallel=tp1pp1"]), (2, ["parallel=tp2pp1", "parallel.sequence_parallel=true"])):
        run_distributed(run_job, world, TRAIN + parallel + [f"checkpoint.load={ckpt}", f"run.dir={tmp_path / str(world)}"])
        runs[world] = read_rows(tmp_path / str(world))
    assert [r["iteration"] for r in runs[2]] == [1, 2]
    for a, b in zip(runs[1], runs[2]):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert runs[1][-1]["lm_loss"] < runs[1][0]["lm_loss"]  # it trains


def _one_line_error(capsys, *args: str) -> str:
    assert _cli(*args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_what_a_family_cannot_express_is_one_line(imported, tmp_path, capsys):
    hf_dir, ckpt, _ = imported["qwen3_moe"]
    cfg = json.loads((hf_dir / "config.json").read_text())
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [0, 1]}))
    err = _one_line_error(capsys, "--import-hf", str(dense), "--output", str(tmp_path / "a"))
    assert "mlp_only_layers=[0, 1] leave no MoE layer; import it as a qwen3 (dense) model" in err
    err = _one_line_error(capsys, "--checkpoint", str(ckpt), "--output", str(tmp_path / "b"), "--format", "hf",
                          "--hf-model-type", "mixtral")
    assert "model.qk_layernorm=True (Mixtral: False)" in err and "model.moe_layer_freq=[1, 0] (Mixtral: every layer, 1)" in err
    err = _one_line_error(capsys, "--checkpoint", str(imported["mixtral"][1]), "--output", str(tmp_path / "c"),
                          "--format", "hf", "--hf-model-type", "mistral")
    assert "model.num_moe_experts=4 (Mistral: dense, null)" in err and not (tmp_path / "c").exists()
