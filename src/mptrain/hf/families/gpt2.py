"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, gelu, learned absolute positions, tied embeddings, biases, multi-head
attention; Conv1D stores ``[in, out]``, so its linear weights are transposed (names: docs/CHECKPOINTS.md). HF's
``gelu_new`` (tanh approximation, OpenAI's GPT-2) imports as our exact erf gelu, with a note. Source: transformers
``models/gpt2/modeling_gpt2.py``.
"""

from __future__ import annotations

from mptrain.errors import ConfigError
from mptrain.hf import Family
from mptrain.hf.mapping import FusedQKV, Rule


class GPT2(Family):
    ignored = r"\.attn\.(bias|masked_bias)$"  # the causal-mask buffers of older transformers

    def model_from_config(self, cfg: dict, notes: list) -> dict:
        act = cfg.get("activation_function", "gelu_new")
        if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            notes.append(f"activation_function={act} (tanh approximation) imported as model.activation=gelu (exact erf)")
        elif act != "gelu":
            raise ConfigError(f"import-hf: activation_function={act!r} is not supported (gelu / gelu_new)")
        h, positions = int(cfg["n_embd"]), int(cfg["n_positions"])
        return {"name": "gpt2", "num_layers": int(cfg["n_layer"]), "hidden_size": h, "num_attention_heads": int(cfg["n_head"]),
                "ffn_hidden_size": cfg.get("n_inner") or 4 * h, "max_position_embeddings": positions,
                "seq_length": positions, "vocab_size": int(cfg["vocab_size"]), "normalization": "LayerNorm",
                "layernorm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)), "activation": "gelu",
                "position_embedding_type": "learned_absolute", "add_bias_linear": True,
                "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", True)}

    def config_from_model(self, model: dict) -> dict:
        h, dropout = model["hidden_size"], model.get("hidden_dropout", 0.0)
        return {"architectures": [self.architecture], "model_type": self.model_type, "n_embd": h, "n_layer": model["num_layers"],
                "n_positions": model.get("max_position_embeddings") or model["seq_length"], "activation_function": "gelu",
                "n_head": model["num_attention_heads"], "n_inner": model.get("ffn_hidden_size") or 4 * h,
                "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": model.get("attention_dropout", 0.0),
                "layer_norm_epsilon": model.get("layernorm_epsilon", 1e-5), "tie_word_embeddings": True,
                "initializer_range": model.get("init_method_std", 0.02), "scale_attn_weights": True}

    def problems(self, model: dict) -> list:
        h, heads = model["hidden_size"], model["num_attention_heads"]
        out = [f"model.{key}={model.get(key)!r} (GPT-2: {want!r})" for key, want in (
            ("normalization", "LayerNorm"), ("activation", "gelu"), ("position_embedding_type", "learned_absolute"),
            ("untie_embeddings_and_output_weights", False), ("add_bias_linear", True),
            ("apply_layernorm_1p", False), ("qk_layernorm", False), ("num_moe_experts", None))
            if model.get(key, want) != want]  # 1p: weights stored as gamma - 1
        if model.get("num_query_groups") not in (None, heads):
            out.append(f"model.num_query_groups={model['num_query_groups']} (GPT-2: multi-head, = {heads})")
        if model.get("kv_channels") not in (None, h // heads):
            out.append(f"model.kv_channels={model['kv_channels']} (GPT-2: hidden_size / heads = {h // heads})")
        return out

    def rules(self, model: dict, names=()) -> list:
        heads, kinds = model["num_attention_heads"], ("weight", "bias")
        out = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
               Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
               *(Rule(f"decoder.final_layernorm.{k}", (f"transformer.ln_f.{k}",)) for k in kinds)]
        for ours, hf, k in ((f"decoder.layers.{i}", f"transformer.h.{i}", k) for i in range(model["num_layers"]) for k in kinds):
            out += [Rule(f"{ours}.input_layernorm.{k}", (f"{hf}.ln_1.{k}",)),
                    FusedQKV(f"{ours}.self_attention.linear_qkv.{k}", (f"{hf}.attn.c_attn.{k}",), heads=heads,
                             groups=heads, transpose=True),
                    Rule(f"{ours}.self_attention.linear_proj.{k}", (f"{hf}.attn.c_proj.{k}",), transpose=True),
                    Rule(f"{ours}.pre_mlp_layernorm.{k}", (f"{hf}.ln_2.{k}",)),
                    Rule(f"{ours}.mlp.linear_fc1.{k}", (f"{hf}.mlp.c_fc.{k}",), transpose=True),
                    Rule(f"{ours}.mlp.linear_fc2.{k}", (f"{hf}.mlp.c_proj.{k}",), transpose=True)]
        if model.get("untie_embeddings_and_output_weights"):
            out.append(Rule("output_layer.weight", (self.head,)))
        return out

    def stored_name(self, name: str) -> str:
        # GPT2Model's files (OpenAI's own checkpoint among them) store the names without the prefix
        return name if name.startswith(("transformer.", "lm_head")) else f"transformer.{name}"


FAMILIES = (GPT2("gpt2", "GPT2LMHeadModel", "GPT-2"),)
