"""Routing statistics of a training iteration, for metrics.jsonl and the console, without a host read of
their own.

Each `TopKRouter` accumulates per micro-batch (training, grad enabled: once per micro-batch also under
recomputation) its ``routing_stats``: the tokens that chose each expert (before capacity dropping), the
dropped assignments, and its aux and z losses divided by their coefficients. `RoutingStats.reduce` moves
them into one vector over all MoE layers of the model (zeros for the layers of other pipeline stages),
resets the routers and sums the vector over every rank (one all-reduce of the default group: the TP ranks
under sequence parallelism, the DP ranks and the stages routed different tokens or layers). The trainer
reads the vector with the loss in its one host read per iteration (`mptrain.training.step.StepRead`);
`RoutingStats.summary` turns it into the row's keys:

    moe_aux_loss                 mean over MoE layers and the global batch's micro-batches of the
                                 load-balancing loss / coeff (1 = balanced); null when off
    moe_z_loss                   same for the z-loss; null when off
    moe_tokens_per_expert_min    per MoE layer: the least-chosen expert's tokens in the iteration
    moe_tokens_per_expert_max    per MoE layer: the most-chosen expert's (balanced: T·k/E each)
    moe_dropped_tokens           token-expert assignments dropped by the capacity in the iteration, summed over
                                 the MoE layers; null when dropless
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mptrain.layers.moe.config import is_moe, moe_layer_pattern
from mptrain.layers.moe.router import TopKRouter, routing_stats_size

STAT_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max",
             "moe_dropped_tokens")
"""The keys `RoutingStats.summary` adds to a metrics.jsonl train row, in order."""


class RoutingStats:
    """The routing statistics of one model (module docstring).

    Args:
        model: ModelConfig of an MoE model.
    """

    def __init__(self, model) -> None:
        self.layers = [n for n, moe in enumerate(moe_layer_pattern(model)) if moe]
        self.num_experts = model.num_moe_experts
        self.width = routing_stats_size(self.num_experts)
        self.aux = model.moe_router_load_balancing_type != "none" and model.moe_aux_loss_coeff > 0
        self.z = bool(model.moe_z_loss_coeff)
        self.capacity = model.moe_expert_capacity_factor is not None

    @classmethod
    def for_model(cls, model) -> Optional["RoutingStats"]:
        """The statistics of ``model``, or None for a dense model."""
        return cls(model) if is_moe(model) else None

    @property
    def size(self) -> int:
        """Length of the reduced vector: ``width`` entries per MoE layer."""
        return len(self.layers) * self.width

    def reduce(self, model_chunks: list, device: torch.device) -> torch.Tensor:
        """This iteration's statistics of every MoE layer, summed over all ranks; the routers reset.

        Collective over the default group (every rank calls it, with or without MoE layers of its own).
        Returns:
            ``[size]`` fp32 on ``device``.
        """
        vec = torch.zeros(len(self.layers), self.width, dtype=torch.float32, device=device)
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    vec[self.layers.index(module.layer_number)] += module.routing_stats
                    module.routing_stats.zero_()
        vec = vec.reshape(-1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
        return vec

    def summary(self, values: list, micro_batches: int) -> dict:
        """The row's keys (`STAT_KEYS`) from the reduced vector read on the host.

        Args:
            values: the `reduce` vector as floats.
            micro_batches: micro-batches of the global batch (num_microbatches × dp): the losses' divisor.
        """
        e = self.num_experts
        rows = [values[i * self.width:(i + 1) * self.width] for i in range(len(self.layers))]
        mean = (lambda j: sum(r[j] for r in rows) / (len(rows) * micro_batches)) if rows else (lambda j: None)
        return {
            "moe_aux_loss": mean(e + 1) if self.aux else None,
            "moe_z_loss": mean(e + 2) if self.z else None,
            "moe_tokens_per_expert_min": [int(min(r[:e])) for r in rows],
            "moe_tokens_per_expert_max": [int(max(r[:e])) for r in rows],
            "moe_dropped_tokens": int(sum(r[e] for r in rows)) if self.capacity else None,
        }
