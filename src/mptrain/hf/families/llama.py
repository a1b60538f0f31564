"""Llama (2 / 3 / 3.x) and its variants Mistral, Qwen2 (2.5), Qwen3: RMSNorm, SwiGLU, RoPE with ``llama3`` scaling (ours
rotates halves, as theirs), grouped-query attention (FusedQKV), gate / up (GatedMLP), tied or untied embeddings (names:
docs/CHECKPOINTS.md). The variants differ in biases (Llama: every linear or none; Mistral, Qwen3: none; Qwen2: q, k, v),
sliding-window keys (a window shorter than the positions is refused) and Qwen3's q / k norms (model.qk_layernorm).
Sources: transformers ``models/{llama,mistral,qwen2,qwen3}/``, Megatron-LM ``tools/checkpoint/loader_llama_mistral.py``.
"""

from __future__ import annotations

import dataclasses

from mptrain.errors import ConfigError
from mptrain.hf import Family
from mptrain.hf.mapping import FusedQKV, GatedMLP, Rule

_SAME = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
         "ffn_hidden_size": "intermediate_size", "vocab_size": "vocab_size", "layernorm_epsilon": "rms_norm_eps",
         "attention_dropout": "attention_dropout", "init_method_std": "initializer_range"}  # ours -> theirs, as is
_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(cfg: dict) -> tuple[float, dict]:  # (theta, llama3 scaling or {}): transformers 5's keys or the older
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in (None, "default", "llama3"):
        raise ConfigError(f"import-hf: config.json rope type {kind!r} is not supported (default, llama3)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), scaling if kind == "llama3" else {}


@dataclasses.dataclass(frozen=True)
class LlamaFamily(Family):
    biases: tuple = ("none",)  # the biases it expresses: "all" (every linear), "qkv" (q, k, v only), "none"
    window: str = "key"  # config.json's sliding_window: "key", "opt_in" (Qwen2: with use_sliding_window), "" (none)
    qk_norm: bool = False  # Qwen3's q_norm / k_norm: model.qk_layernorm
    ignored = r"rotary_emb\.inv_freq$"

    def moe_problems(self, model: dict) -> list:  # what of our MoE keys it cannot express (dense: any expert)
        experts = model.get("num_moe_experts")
        return [] if experts is None else [f"model.num_moe_experts={experts} ({self.title}: dense, null)"]

    def mlp_rules(self, model: dict, i: int, kinds: tuple) -> list:  # layer i's MLP (kinds: weight, bias)
        ours, hf = f"decoder.layers.{i}.mlp", f"model.layers.{i}.mlp"
        return [r for k in kinds for r in (GatedMLP(f"{ours}.linear_fc1.{k}", (f"{hf}.gate_proj.{k}", f"{hf}.up_proj.{k}")),
                                           Rule(f"{ours}.linear_fc2.{k}", (f"{hf}.down_proj.{k}",)))]

    def model_from_config(self, cfg: dict, notes: list) -> dict:
        positions, (theta, scaling) = int(cfg.get("max_position_embeddings", 2048)), _rope(cfg)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", self.window != "opt_in") else None
        wrong = [text for bad, text in (
            (window is not None and int(window) < positions, f"sliding_window={window} < {positions} positions"),
            (cfg.get("hidden_act", "silu") != "silu", f"hidden_act={cfg.get('hidden_act')!r} (silu, as SwiGLU)"),
            (cfg.get("partial_rotary_factor", 1.0) != 1.0, f"partial_rotary_factor={cfg.get('partial_rotary_factor')}"),
            (theta != int(theta), f"rope_theta={theta} (model.rotary_base is an integer)"),
            (bool(cfg.get("attention_bias")) != bool(cfg.get("mlp_bias")), "attention_bias != mlp_bias")) if bad]
        if wrong:
            raise ConfigError(f"import-hf: config.json {', '.join(wrong)} is not supported")
        h, heads, head_dim = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), cfg.get("head_dim")
        bias = self.biases[0] if len(self.biases) == 1 else "all" if cfg.get("attention_bias") else "none"
        model = {ours: cfg[key] for ours, key in _SAME.items() if key in cfg}
        model.update(name=self.model_type, num_query_groups=int(cfg.get("num_key_value_heads") or heads),
                     kv_channels=None if (head_dim or h // heads) * heads == h else int(head_dim), hidden_dropout=0.0,
                     seq_length=positions, max_position_embeddings=positions, normalization="RMSNorm",
                     activation="swiglu", untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
                     position_embedding_type="rope", rotary_base=int(theta), rope_scaling=bool(scaling),
                     add_bias_linear=bias == "all", add_qkv_bias=bias != "none", qk_layernorm=self.qk_norm)
        return {**model, **{f"rope_scaling_{k}": scaling[k] for k in _SCALING if scaling}}

    def config_from_model(self, model: dict) -> dict:
        h, heads, bias = model["hidden_size"], model["num_attention_heads"], model.get("add_bias_linear", False)
        rope = {"rope_type": "default", "rope_theta": float(model.get("rotary_base", 10000))}
        if model.get("rope_scaling"):
            rope.update(rope_type="llama3", **{k: model[f"rope_scaling_{k}"] for k in _SCALING})
        return {"architectures": [self.architecture], "model_type": self.model_type, "intermediate_size": 4 * h,
                **{key: model[ours] for ours, key in _SAME.items() if model.get(ours) is not None},
                "num_key_value_heads": model.get("num_query_groups") or heads, "hidden_act": "silu",
                "head_dim": model.get("kv_channels") or h // heads, "use_cache": True,
                "max_position_embeddings": model.get("max_position_embeddings") or model["seq_length"],
                "rope_theta": rope["rope_theta"], "rope_scaling": rope if model.get("rope_scaling") else None,
                "rope_parameters": rope, "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights"),
                **({"attention_bias": bias, "mlp_bias": bias} if len(self.biases) > 1 else {}),  # Llama's keys
                **({"sliding_window": None} if self.window else {}),  # exports use full attention
                **({"use_sliding_window": False} if self.window == "opt_in" else {})}

    def problems(self, model: dict) -> list:
        out = [f"model.{key}={model.get(key)!r} ({self.title}: {want!r})" for key, want in (("normalization", "RMSNorm"),
               ("activation", "swiglu"), ("position_embedding_type", "rope"), ("rotary_percent", 1.0),
               ("qk_layernorm", self.qk_norm)) if model.get(key, want if key != "qk_layernorm" else False) != want]
        out += self.moe_problems(model)  # partial RoPE: Llama's attention rotates whole heads
        bias = "all" if model.get("add_bias_linear") else "qkv" if model.get("add_qkv_bias") else "none"
        if bias not in self.biases:
            out.append(f"model.add_bias_linear={model.get('add_bias_linear')}, add_qkv_bias={model.get('add_qkv_bias')} "
                       f"({self.title}: biases on {' or '.join(self.biases)})")
        return out

    def rules(self, model: dict, names=()) -> list:
        heads, ng = model["num_attention_heads"], model.get("num_query_groups") or model["num_attention_heads"]
        kinds = ("weight", "bias") if model.get("add_bias_linear") else ("weight",)
        qkv_kinds = ("weight", "bias") if model.get("add_bias_linear") or model.get("add_qkv_bias") else ("weight",)
        out = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
               Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
        for i in range(model["num_layers"]):
            ours, hf = f"decoder.layers.{i}", f"model.layers.{i}"
            out += [Rule(f"{ours}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)),
                    Rule(f"{ours}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)),
                    *(FusedQKV(f"{ours}.self_attention.linear_qkv.{k}", tuple(f"{hf}.self_attn.{p}_proj.{k}" for p in "qkv"),
                               heads=heads, groups=ng) for k in qkv_kinds),
                    *(Rule(f"{ours}.self_attention.{p}_layernorm.weight", (f"{hf}.self_attn.{p}_norm.weight",))
                      for p in ("q", "k") if self.qk_norm),
                    *(Rule(f"{ours}.self_attention.linear_proj.{k}", (f"{hf}.self_attn.o_proj.{k}",)) for k in kinds),
                    *self.mlp_rules(model, i, kinds)]
        if model.get("untie_embeddings_and_output_weights"):
            out.append(Rule("output_layer.weight", (self.head,)))
        return out


FAMILIES = (LlamaFamily("llama", "LlamaForCausalLM", "Llama", biases=("none", "all"), window=""),
            LlamaFamily("mistral", "MistralForCausalLM", "Mistral"),
            LlamaFamily("qwen2", "Qwen2ForCausalLM", "Qwen2", biases=("qkv",), window="opt_in"),
            LlamaFamily("qwen3", "Qwen3ForCausalLM", "Qwen3", window="opt_in", qk_norm=True))
