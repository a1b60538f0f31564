"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a Mixture of Experts in every layer, E experts (SwiGLU, no
biases) of width ``intermediate_size``, a linear router ``gate [E, h]``, softmax over the E logits, top-k, the k weights
renormalised to sum 1, which is Megatron's post-softmax routing (softmax over the k chosen logits; model.moe_router_*
docs/CONFIG.md). Names: ``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2``
(down) as the Hub's files and transformers' ``save_pretrained`` keep them, or transformers 5's fused
``mlp.gate`` / ``mlp.experts.gate_up_proj`` / ``down_proj`` (read; exports write the former). Source: transformers
``models/mixtral/modeling_mixtral.py``, ``conversion_mapping.py``; Megatron-Bridge ``mixtral_bridge.py``.
"""

from __future__ import annotations

import dataclasses

from mptrain.hf.families.llama import LlamaFamily
from mptrain.hf.mapping import Experts, Rule


def expert_rules(i: int, prefix: str, num_experts: int, names: tuple, fused: bool) -> list:
    """The router and grouped-expert rules of MoE layer ``i`` whose Hugging Face block is ``model.layers.{i}.<prefix>``
    (router ``gate``; per-expert ``experts.{e}.<gate|up|down>.weight``, ``names`` = (gate, up, down), or with ``fused``
    transformers 5's ``experts.gate_up_proj [E, 2f, h]`` / ``experts.down_proj [E, h, f]``, ours as they are)."""
    ours, hf = f"decoder.layers.{i}.mlp", f"model.layers.{i}.{prefix}"
    fc1, fc2 = f"{ours}.experts.linear_fc1.weight", f"{ours}.experts.linear_fc2.weight"
    out = [Rule(f"{ours}.router.weight", (f"{hf}.gate.weight",))]
    if fused:
        return out + [Rule(fc1, (f"{hf}.experts.gate_up_proj",)), Rule(fc2, (f"{hf}.experts.down_proj",))]
    gate, up, down = names
    return out + [Experts(fc1, tuple(f"{hf}.experts.{e}.{p}.weight" for e in range(num_experts) for p in (gate, up)),
                          parts=2),
                  Experts(fc2, tuple(f"{hf}.experts.{e}.{down}.weight" for e in range(num_experts)))]


def routing_problems(model: dict, title: str, pre_softmax: tuple) -> list:
    """What of our routing a Hugging Face softmax top-k router (no shared expert) cannot express; ``pre_softmax``: the
    model.moe_router_pre_softmax values it has."""
    if model.get("num_moe_experts") is None:
        return [f"model.num_moe_experts=None ({title}: experts)"]
    return [f"model.{key}={model.get(key, want)!r} ({title}: {' or '.join(map(repr, wants))})" for key, want, wants in (
        ("moe_router_score_function", "softmax", ("softmax",)),
        ("moe_router_pre_softmax", False, pre_softmax), ("moe_router_topk_scaling_factor", None, (None,)),
        ("moe_router_enable_expert_bias", False, (False,)), ("moe_shared_expert_intermediate_size", None, (None,)))
        if model.get(key, want) not in wants]


def layer_pattern(model: dict) -> list:
    """1 / 0 per layer: MoE or dense (model.moe_layer_freq, an int N or the list)."""
    freq = model.get("moe_layer_freq", 1)
    return [int(i % freq == 0) for i in range(model["num_layers"])] if isinstance(freq, int) else list(freq)


@dataclasses.dataclass(frozen=True)
class MixtralFamily(LlamaFamily):
    fused: bool = False  # the folder holds transformers 5's fused expert tensors

    def model_from_config(self, cfg: dict, notes: list) -> dict:
        jitter = float(cfg.get("router_jitter_noise") or 0.0)
        if jitter:
            notes.append(f"router_jitter_noise={jitter} imported as model.moe_input_jitter_eps (training only: Megatron "
                         "jitters the router's input, transformers' Mixtral the experts' input too)")
        return {**super().model_from_config(cfg, notes), "num_moe_experts": int(cfg["num_local_experts"]),
                "moe_router_topk": int(cfg["num_experts_per_tok"]), "moe_layer_freq": 1,
                "moe_ffn_hidden_size": int(cfg["intermediate_size"]), "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": False, "moe_aux_loss_coeff": float(cfg.get("router_aux_loss_coef") or 0.0),
                "moe_input_jitter_eps": jitter or None}

    def config_from_model(self, model: dict) -> dict:
        width = model.get("moe_ffn_hidden_size") or model.get("ffn_hidden_size") or 4 * model["hidden_size"]
        return {**super().config_from_model(model), "intermediate_size": width,
                "num_local_experts": model["num_moe_experts"], "num_experts_per_tok": model.get("moe_router_topk", 2),
                "router_aux_loss_coef": model.get("moe_aux_loss_coeff", 0.0), "output_router_logits": False,
                "router_jitter_noise": model.get("moe_input_jitter_eps") or 0.0}

    def moe_problems(self, model: dict) -> list:
        out = routing_problems(model, self.title, (False,))
        if not out and 0 in layer_pattern(model):
            out.append(f"model.moe_layer_freq={model['moe_layer_freq']!r} ({self.title}: every layer, 1)")
        return out

    def import_rules(self, model: dict, names) -> list:
        return dataclasses.replace(self, fused=any(n.endswith(".experts.gate_up_proj") for n in names)).rules(model)

    def mlp_rules(self, model: dict, i: int, kinds: tuple) -> list:
        return expert_rules(i, "mlp" if self.fused else "block_sparse_moe", model["num_moe_experts"], ("w1", "w3", "w2"),
                            self.fused)


FAMILIES = (MixtralFamily("mixtral", "MixtralForCausalLM", "Mixtral"),)
