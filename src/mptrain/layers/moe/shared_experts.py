"""`SharedExpertMLP`: the MoE layer's shared expert (Megatron-core
``megatron/core/transformer/moe/shared_experts.py``; DeepSeekMoE, Qwen2-MoE).

A dense MLP of width ``model.moe_shared_expert_intermediate_size`` on every token (TP-sharded as the
dense MLP, `mptrain.layers.mlp.MLP`), its output added to the routed experts'. With
``model.moe_shared_expert_gate`` the output is scaled by ``sigmoid(x gᵀ)``, ``g = gate_weight [1, h]``
(Qwen2-MoE's ``shared_expert_gate``), replicated over TP (its grad summed over TP under sequence
parallelism, where each rank saw its own tokens). Parameters: ``decoder.layers.<n>.mlp.shared_experts.
{linear_fc1,linear_fc2}.weight`` and ``...shared_experts.gate_weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mptrain.layers.context import LayerContext
from mptrain.layers.mlp import MLP
from mptrain.layers.sharding import ShardSpec

KEY = "model.transformer_layer.submodules.moe.submodules.shared_experts"


class SharedExpertMLP(MLP):
    """forward(x ``[s(/tp), b, h]``) -> ``[s(/tp), b, h]``: the MLP's output, gated when configured.

    Args: as `mptrain.layers.mlp.MLP` (config, context, layer_number, submodules).
    """

    def __init__(self, config, context: LayerContext, *, layer_number: int, submodules=None) -> None:
        prefix = f"decoder.layers.{layer_number}.mlp.shared_experts"
        super().__init__(config, context, layer_number=layer_number, submodules=submodules,
                         ffn_hidden_size=config.moe_shared_expert_intermediate_size, prefix=prefix, key=KEY)
        self.gate_weight = None
        self._sequence_parallel = context.sequence_parallel
        if config.moe_shared_expert_gate:
            g = context.init.normal(f"{prefix}.gate_weight", (1, config.hidden_size))
            self.gate_weight = torch.nn.Parameter(g.to(device=context.device, dtype=context.params_dtype))

    def local_shard_specs(self) -> dict:
        if self.gate_weight is None:
            return {}
        return {"gate_weight": ShardSpec(global_shape=(1, self.gate_weight.shape[1]),
                                         sequence_parallel_grad=self._sequence_parallel)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))  # [s, b, 1]
        return out
