"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (query / key RMSNorm over the head dim: model.qk_layernorm) with
a Mixture of Experts on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` pick (layer l is MoE iff l is not in
mlp_only_layers and (l + 1) % decoder_sparse_step == 0: model.moe_layer_freq as a 0/1 list, or 1), the others a dense
SwiGLU MLP of width ``intermediate_size``. E experts of width ``moe_intermediate_size``; the router takes softmax over E,
top-k, and with ``norm_topk_prob`` renormalises the k weights (Megatron's post-softmax routing,
model.moe_router_pre_softmax=false), without it keeps them (pre-softmax routing, true). ``router_aux_loss_coef`` is
model.moe_aux_loss_coeff. Names: ``mlp.gate``, ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, or
transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (read; exports write the former); config.json's
``num_experts`` (transformers 5 writes ``num_local_experts``: both read). Source: transformers
``models/qwen3_moe/modeling_qwen3_moe.py``; Megatron-Bridge ``qwen3_moe_bridge.py``.
"""

from __future__ import annotations

from mptrain.errors import ConfigError
from mptrain.hf.families.mixtral import MoeFamily, layer_pattern


class Qwen3MoeFamily(MoeFamily):
    def model_from_config(self, cfg: dict, notes: list) -> dict:
        layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
        experts, dense = int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0), set(cfg.get("mlp_only_layers") or ())
        pattern = [int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(layers)]
        if not any(pattern):
            raise ConfigError(f"import-hf: config.json num_experts={experts}, decoder_sparse_step={step}, mlp_only_layers="
                              f"{sorted(dense)} leave no MoE layer; import it as a qwen3 (dense) model")
        return {**super().model_from_config(cfg, notes), "num_moe_experts": experts,
                "moe_layer_freq": 1 if all(pattern) else pattern,
                "moe_router_pre_softmax": not cfg.get("norm_topk_prob", False)}

    def config_from_model(self, model: dict) -> dict:
        return {**super().config_from_model(model), "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, moe in enumerate(layer_pattern(model)) if not moe],
                "norm_topk_prob": not model.get("moe_router_pre_softmax", False), "attention_bias": False,
                "max_window_layers": model["num_layers"]}


FAMILIES = (Qwen3MoeFamily("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", window="opt_in", qk_norm=True,
                           keys=("num_experts", "moe_intermediate_size"), block="mlp",
                           parts=("gate_proj", "up_proj", "down_proj"), pre_softmax=(False, True)),)
