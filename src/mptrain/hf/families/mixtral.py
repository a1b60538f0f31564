"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a Mixture of Experts in every layer, E experts (SwiGLU, no
biases) of width ``intermediate_size``, a linear router ``gate [E, h]``, softmax over the E logits, top-k, the k weights
renormalised to sum 1, which is Megatron's post-softmax routing (softmax over the k chosen logits; model.moe_router_*
docs/CONFIG.md). Names: ``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2``
(down) as the Hub's files and transformers' ``save_pretrained`` keep them, or transformers 5's fused
``mlp.gate`` / ``mlp.experts.gate_up_proj`` / ``down_proj`` (read; exports write the former). Source: transformers
``models/mixtral/modeling_mixtral.py``, ``conversion_mapping.py``; Megatron-Bridge ``mixtral_bridge.py``. `MoeFamily`
holds what the MoE families share (qwen3_moe.py subclasses it).
"""

from __future__ import annotations

import dataclasses

from mptrain.hf.families.llama import LlamaFamily
from mptrain.hf.mapping import Experts, Rule


def layer_pattern(model: dict) -> list:
    """1 / 0 per layer: MoE or dense (model.moe_layer_freq, an int N or the list)."""
    freq = model.get("moe_layer_freq", 1)
    return [int(i % freq == 0) for i in range(model["num_layers"])] if isinstance(freq, int) else list(freq)


@dataclasses.dataclass(frozen=True)
class MoeFamily(LlamaFamily):
    """A Llama family whose MoE layers hold a softmax top-k router (no shared expert) and SwiGLU experts; config.json
    names the expert count and width ``keys``. MoE layer i's block is ``model.layers.{i}.<block>``: the router ``gate``
    and per-expert ``experts.{e}.<gate|up|down>.weight`` (``parts``), or with ``fused`` (block ``mlp``) transformers 5's
    ``experts.gate_up_proj [E, 2f, h]`` / ``experts.down_proj [E, h, f]``, ours as they are."""

    keys: tuple = ("num_local_experts", "intermediate_size")
    block: str = "block_sparse_moe"
    parts: tuple = ("w1", "w3", "w2")
    pre_softmax: tuple = (False,)  # the model.moe_router_pre_softmax values its router expresses
    fused: bool = False  # the folder holds transformers 5's fused expert tensors

    def model_from_config(self, cfg: dict, notes: list) -> dict:  # the MoE keys every family reads alike
        return {**super().model_from_config(cfg, notes), "moe_router_topk": int(cfg["num_experts_per_tok"]),
                "moe_ffn_hidden_size": int(cfg[self.keys[1]]), "moe_router_score_function": "softmax",
                "moe_aux_loss_coeff": float(cfg.get("router_aux_loss_coef") or 0.0)}

    def config_from_model(self, model: dict) -> dict:
        width = model.get("moe_ffn_hidden_size") or model.get("ffn_hidden_size") or 4 * model["hidden_size"]
        return {**super().config_from_model(model), **dict(zip(self.keys, (model["num_moe_experts"], width))),
                "num_experts_per_tok": model.get("moe_router_topk", 2),
                "router_aux_loss_coef": model.get("moe_aux_loss_coeff", 0.0), "output_router_logits": False}

    def moe_problems(self, model: dict) -> list:
        if model.get("num_moe_experts") is None:
            return [f"model.num_moe_experts=None ({self.title}: experts)"]
        wants = {"moe_router_score_function": ("softmax",), "moe_router_pre_softmax": self.pre_softmax,  # unset: [0]
                 "moe_router_topk_scaling_factor": (None,), "moe_router_enable_expert_bias": (False,),
                 "moe_shared_expert_intermediate_size": (None,)}
        return [f"model.{key}={model.get(key, want[0])!r} ({self.title}: {' or '.join(map(repr, want))})"
                for key, want in wants.items() if model.get(key, want[0]) not in want]

    def rules(self, model: dict, names=()) -> list:
        if any(n.endswith(".experts.gate_up_proj") for n in names):  # a folder of transformers 5's fused experts
            return dataclasses.replace(self, fused=True).rules(model)
        return super().rules(model)

    def mlp_rules(self, model: dict, i: int, kinds: tuple) -> list:
        if not layer_pattern(model)[i]:
            return super().mlp_rules(model, i, kinds)
        ours, hf = f"decoder.layers.{i}.mlp", f"model.layers.{i}.{'mlp' if self.fused else self.block}"
        fc1, fc2 = f"{ours}.experts.linear_fc1.weight", f"{ours}.experts.linear_fc2.weight"
        out = [Rule(f"{ours}.router.weight", (f"{hf}.gate.weight",))]
        if self.fused:
            return out + [Rule(fc1, (f"{hf}.experts.gate_up_proj",)), Rule(fc2, (f"{hf}.experts.down_proj",))]
        (gate, up, down), experts = self.parts, range(model["num_moe_experts"])
        return out + [Experts(fc1, tuple(f"{hf}.experts.{e}.{p}.weight" for e in experts for p in (gate, up)), parts=2),
                      Experts(fc2, tuple(f"{hf}.experts.{e}.{down}.weight" for e in experts))]


class MixtralFamily(MoeFamily):
    def model_from_config(self, cfg: dict, notes: list) -> dict:
        jitter = float(cfg.get("router_jitter_noise") or 0.0)
        if jitter:
            notes.append(f"router_jitter_noise={jitter} imported as model.moe_input_jitter_eps (training only: Megatron "
                         "jitters the router's input, transformers' Mixtral the experts' input too)")
        return {**super().model_from_config(cfg, notes), "num_moe_experts": int(cfg["num_local_experts"]),
                "moe_layer_freq": 1, "moe_router_pre_softmax": False, "moe_input_jitter_eps": jitter or None}

    def config_from_model(self, model: dict) -> dict:
        return {**super().config_from_model(model), "router_jitter_noise": model.get("moe_input_jitter_eps") or 0.0}

    def moe_problems(self, model: dict) -> list:
        out = super().moe_problems(model)
        if not out and 0 in layer_pattern(model):
            out.append(f"model.moe_layer_freq={model['moe_layer_freq']!r} ({self.title}: every layer, 1)")
        return out


FAMILIES = (MixtralFamily("mixtral", "MixtralForCausalLM", "Mixtral"),)
