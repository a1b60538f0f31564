"""Hugging Face causal-LM families and mptrain's model: config.json <-> model config, tensor names and layouts.

Families (``config.json``'s ``model_type``, else its ``architectures``): ``llama`` (Llama 2 / 3 / 3.1 /
3.2: RMSNorm, SwiGLU, RoPE with ``rope_theta`` and the ``llama3`` frequency scaling, grouped-query
attention, tied or untied embeddings), ``mistral`` (Llama's architecture; a sliding window shorter
than the positions is refused), ``qwen2`` (Qwen2 / Qwen2.5: Llama's plus a QKV bias) and ``gpt2``
(its mapping lives in `mptrain.export`). Anything else (MoE, sliding-window attention, other RoPE
types, other activations) is a `ConfigError` naming what is not supported.

Tensor layouts, our tp1pp1 name <- Hugging Face name (``L`` = ``model.layers.i``), per layer ``i``:

    embedding.word_embeddings.weight                  model.embed_tokens.weight          [V, h]
    decoder.layers.i.input_layernorm.weight           L.input_layernorm.weight           [h]
    decoder.layers.i.self_attention.linear_qkv.weight L.self_attn.{q,k,v}_proj.weight    regrouped (below)
    decoder.layers.i.self_attention.linear_qkv.bias   L.self_attn.{q,k,v}_proj.bias      (qwen2) regrouped
    decoder.layers.i.self_attention.linear_proj.*     L.self_attn.o_proj.*               [h, np·hn]
    decoder.layers.i.pre_mlp_layernorm.weight         L.post_attention_layernorm.weight  [h]
    decoder.layers.i.mlp.linear_fc1.*                 L.mlp.{gate,up}_proj.*             [gate; up] = [2f, h]
    decoder.layers.i.mlp.linear_fc2.*                 L.mlp.down_proj.*                  [h, f]
    decoder.final_layernorm.weight                    model.norm.weight                  [h]
    output_layer.weight                               lm_head.weight                     (untied only) [V, h]

Fused QKV: Hugging Face keeps ``q_proj`` rows head-major ``[np·hn, h]`` and ``k_proj`` / ``v_proj``
``[ng·hn, h]``; ours are grouped by query group g: ``[q_{g,0..np/ng-1}, k_g, v_g]``
(`mptrain.layers.attention`), so q is viewed ``[ng, np/ng, hn, h]``, k and v ``[ng, 1, hn, h]``, and
the three are concatenated on dim 1. RoPE needs no permutation: mptrain's RoPE rotates halves
(``rotate_half``), as Hugging Face's Llama does (``convert_llama_weights_to_hf.py`` permutes Meta's
interleaved checkpoints into that convention). The vocabulary is unpadded on both sides: checkpoints
hold ``[V, h]`` and each layout pads to ``make_vocab_size_divisible_by`` × tp when it loads.

Source for the layouts: transformers ``models/llama/modeling_llama.py`` (``LlamaAttention``,
``LlamaMLP``), ``models/qwen2/modeling_qwen2.py``; Megatron-LM ``tools/checkpoint/loader_llama_mistral.py``.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from mptrain.errors import ConfigError

LLAMA_LIKE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""Llama-architecture families: model_type -> the ``architectures`` entry of an export."""
FAMILIES = (*LLAMA_LIKE, "gpt2")
_ARCHITECTURES = {**{arch: family for family, arch in LLAMA_LIKE.items()}, "GPT2LMHeadModel": "gpt2"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def family_of(cfg: dict, where: str = "config.json") -> str:
    """The family of a ``config.json`` dict: its ``model_type``, else its first known ``architectures`` entry.

    Raises:
        ConfigError: neither names a supported family (one line listing them).
    """
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return model_type
    for arch in cfg.get("architectures") or ():
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ConfigError(f"import-hf: {where} has model_type={model_type!r} (architectures {cfg.get('architectures')}), "
                      f"which is not supported; supported model_type: {', '.join(FAMILIES)}")


def torch_dtype_of(cfg: dict) -> torch.dtype:
    """The dtype ``config.json`` declares (``dtype`` / ``torch_dtype``; float32 when absent)."""
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def _rope(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict or {}) from either transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` / ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), {}
    if kind != "llama3":
        raise ConfigError(f"import-hf: config.json rope type {kind!r} is not supported (default, llama3)")
    return float(theta), scaling


def model_from_hf_config(cfg: dict) -> dict:
    """Our model-config dict (Megatron keys, `mptrain.config.model.ModelConfig`) for a Llama-family config.json.

    Raises:
        ConfigError: a feature our model cannot express (one line naming it): a sliding window shorter
            than the positions, MoE experts, an activation other than silu, partial rotary, another
            RoPE type, attention biases without MLP biases (Llama's ``attention_bias`` xor ``mlp_bias``).
    """
    family = family_of(cfg)
    assert family in LLAMA_LIKE, family
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            raise ConfigError(f"import-hf: config.json {key}={cfg[key]}: mixture-of-experts models are not supported")
    positions = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if family == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen2 lists a window but only uses it with use_sliding_window
    if window is not None and int(window) < positions:
        raise ConfigError(f"import-hf: config.json sliding_window={window} < max_position_embeddings={positions}: "
                          "sliding-window attention is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"import-hf: config.json hidden_act={act!r} is not supported (silu, as SwiGLU)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"import-hf: config.json partial_rotary_factor={cfg['partial_rotary_factor']} is not supported (1.0)")
    theta, scaling = _rope(cfg)
    if theta != int(theta):
        raise ConfigError(f"import-hf: config.json rope_theta={theta} is not an integer (model.rotary_base is)")
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    attention_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ConfigError(f"import-hf: config.json attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
                          "supported (model.add_bias_linear sets both)")
    head_dim = cfg.get("head_dim") or h // heads
    model = {
        "name": family, "num_layers": int(cfg["num_hidden_layers"]), "hidden_size": h, "num_attention_heads": heads,
        "num_query_groups": int(cfg.get("num_key_value_heads") or heads), "ffn_hidden_size": int(cfg["intermediate_size"]),
        "kv_channels": None if head_dim * heads == h else int(head_dim), "seq_length": positions,
        "max_position_embeddings": positions, "vocab_size": int(cfg["vocab_size"]),
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "hidden_dropout": 0.0, "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
        "init_method_std": float(cfg.get("initializer_range", 0.02)), "normalization": "RMSNorm",
        "layernorm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)), "activation": "swiglu",
        "position_embedding_type": "rope", "rotary_base": int(theta), "rope_scaling": bool(scaling),
        "add_bias_linear": attention_bias, "add_qkv_bias": family == "qwen2" or attention_bias,
    }
    if scaling:
        model.update(rope_scaling_factor=float(scaling["factor"]),
                     rope_scaling_low_freq_factor=float(scaling["low_freq_factor"]),
                     rope_scaling_high_freq_factor=float(scaling["high_freq_factor"]),
                     rope_scaling_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    return model


def llama_like_family(model: dict) -> str:
    """The family an architecture exports as: qwen2 with a QKV bias alone, else llama.

    Raises:
        ConfigError: the model is not a Llama-family architecture (RMSNorm, swiglu, rope).
    """
    problems = [f"model.{k}={model.get(k)!r} (Llama: {want!r})" for k, want in
                (("normalization", "RMSNorm"), ("activation", "swiglu"), ("position_embedding_type", "rope"))
                if model.get(k) != want]
    if problems:
        raise ConfigError("export --format hf: the model is neither GPT-2 nor Llama-family: " + ", ".join(problems)
                          + "; use --format safetensors")
    return "qwen2" if model.get("add_qkv_bias") and not model.get("add_bias_linear") else "llama"


def hf_config_from_model(model: dict, family: str, *, vocab_size: int, dtype: torch.dtype, bos, eos) -> dict:
    """config.json of ``family`` (llama / mistral / qwen2) for our model dict; the inverse of
    `model_from_hf_config` (RoPE written both as transformers 5's ``rope_parameters`` and the older
    ``rope_theta`` / ``rope_scaling``)."""
    h, heads = model["hidden_size"], model["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": float(model.get("rotary_base", 10000))}
    scaling = None
    if model.get("rope_scaling"):
        scaling = {"rope_type": "llama3", "factor": model["rope_scaling_factor"],
                   "low_freq_factor": model["rope_scaling_low_freq_factor"],
                   "high_freq_factor": model["rope_scaling_high_freq_factor"],
                   "original_max_position_embeddings": model["rope_scaling_original_max_position_embeddings"]}
        rope.update(scaling)
    bias = bool(model.get("add_bias_linear", False))
    cfg = {
        "architectures": [LLAMA_LIKE[family]], "model_type": family, "vocab_size": vocab_size, "hidden_size": h,
        "intermediate_size": model.get("ffn_hidden_size") or 4 * h, "num_hidden_layers": model["num_layers"],
        "num_attention_heads": heads, "num_key_value_heads": model.get("num_query_groups") or heads,
        "head_dim": model.get("kv_channels") or h // heads, "hidden_act": "silu",
        "max_position_embeddings": model.get("max_position_embeddings") or model["seq_length"],
        "rms_norm_eps": model.get("layernorm_epsilon", 1e-5), "rope_theta": rope["rope_theta"], "rope_scaling": scaling,
        "rope_parameters": rope, "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights", False),
        "attention_dropout": model.get("attention_dropout", 0.0), "initializer_range": model.get("init_method_std", 0.02),
        "bos_token_id": bos, "eos_token_id": eos, "dtype": dtype_name(dtype), "use_cache": True,
    }
    if family == "llama":
        cfg.update(attention_bias=bias, mlp_bias=bias)
    elif family == "mistral":
        cfg.update(sliding_window=None)
    else:  # qwen2
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=model["num_layers"])
    return cfg


# --- tensors ---------------------------------------------------------------------------------------
def _qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ng: int) -> torch.Tensor:
    """HF q ``[np·hn(, h)]``, k, v ``[ng·hn(, h)]`` -> our fused rows ``[ng × (np/ng + 2) × hn(, h)]`` (module docstring)."""
    rest = q.shape[1:]
    hn = k.shape[0] // ng
    parts = [q.reshape(ng, -1, hn, *rest), k.reshape(ng, 1, hn, *rest), v.reshape(ng, 1, hn, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _qkv_to_hf(t: torch.Tensor, heads: int, ng: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `_qkv_from_hf`: our fused rows -> HF (q, k, v)."""
    rest = t.shape[1:]
    rep = heads // ng
    grouped = t.reshape(ng, rep + 2, -1, *rest)  # [ng, np/ng + 2, hn(, h)]
    q, k, v = torch.split(grouped, [rep, 1, 1], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _ident(ts: list) -> torch.Tensor:
    return ts[0]


def llama_import_plan(model: dict) -> dict[str, tuple[list, Callable]]:
    """{our tp1pp1 name: ([HF names it is built from], fn(list of those tensors) -> our tensor)}."""
    ng = model.get("num_query_groups") or model["num_attention_heads"]
    plan = {"embedding.word_embeddings.weight": (["model.embed_tokens.weight"], _ident),
            "decoder.final_layernorm.weight": (["model.norm.weight"], _ident)}
    kinds = ["weight", "bias"] if model.get("add_bias_linear") else ["weight"]
    qkv_kinds = ["weight", "bias"] if model.get("add_bias_linear") or model.get("add_qkv_bias") else ["weight"]
    for i in range(model["num_layers"]):
        ours, hf = f"decoder.layers.{i}", f"model.layers.{i}"
        plan[f"{ours}.input_layernorm.weight"] = ([f"{hf}.input_layernorm.weight"], _ident)
        plan[f"{ours}.pre_mlp_layernorm.weight"] = ([f"{hf}.post_attention_layernorm.weight"], _ident)
        for kind in qkv_kinds:
            plan[f"{ours}.self_attention.linear_qkv.{kind}"] = (
                [f"{hf}.self_attn.{p}_proj.{kind}" for p in "qkv"], lambda ts, ng=ng: _qkv_from_hf(*ts, ng))
        for kind in kinds:
            plan[f"{ours}.self_attention.linear_proj.{kind}"] = ([f"{hf}.self_attn.o_proj.{kind}"], _ident)
            plan[f"{ours}.mlp.linear_fc1.{kind}"] = ([f"{hf}.mlp.gate_proj.{kind}", f"{hf}.mlp.up_proj.{kind}"],
                                                     lambda ts: torch.cat(ts, dim=0))
            plan[f"{ours}.mlp.linear_fc2.{kind}"] = ([f"{hf}.mlp.down_proj.{kind}"], _ident)
    if model.get("untie_embeddings_and_output_weights"):
        plan["output_layer.weight"] = (["lm_head.weight"], _ident)
    return plan


def llama_export(name: str, t: torch.Tensor, model: dict) -> dict[str, torch.Tensor]:
    """{HF name: tensor} for our tp1pp1 parameter ``name`` (the inverse of `llama_import_plan`).

    Raises:
        ConfigError: ``name`` has no Llama-family counterpart.
    """
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight",
           "output_layer.weight": "lm_head.weight"}
    if name in top:
        return {top[name]: t}
    m = _LAYER.match(name)
    module, kind = m.group(2).rsplit(".", 1) if m else ("", "")
    hf = f"model.layers.{m.group(1)}" if m else ""
    if module == "self_attention.linear_qkv":
        q, k, v = _qkv_to_hf(t, model["num_attention_heads"], model.get("num_query_groups") or model["num_attention_heads"])
        return {f"{hf}.self_attn.q_proj.{kind}": q, f"{hf}.self_attn.k_proj.{kind}": k, f"{hf}.self_attn.v_proj.{kind}": v}
    if module == "mlp.linear_fc1":
        gate, up = t.chunk(2, dim=0)
        return {f"{hf}.mlp.gate_proj.{kind}": gate, f"{hf}.mlp.up_proj.{kind}": up}
    simple = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
              "self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj"}
    if module not in simple:
        raise ConfigError(f"export --format hf: no Llama-family name for parameter {name}; use --format safetensors")
    return {f"{hf}.{simple[module]}.{kind}": t}
