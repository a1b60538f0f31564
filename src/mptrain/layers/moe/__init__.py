"""Mixture of Experts (Megatron-core ``megatron/core/transformer/moe/``): the layer a transformer layer's
``mlp`` becomes on the layers ``model.moe_layer_freq`` marks (with ``model.num_moe_experts`` set).

Modules: `config` (the model.moe_* rules and what they derive), `routing` (top-k math, token dropping),
`router` (`TopKRouter`), `aux_loss` (aux / z losses and `MoEAuxLossAutoScaler`), `dispatcher`
(`TokenDispatcher`, `LocalDispatcher`), `experts` (`GroupedMLP`), `shared_experts` (`SharedExpertMLP`),
`layer` (`MoELayer` and the spec kinds), `expert_bias` (aux-loss-free balancing's update), `stats`
(routing statistics for metrics.jsonl), `arithmetic` (parameters and FLOPs).
"""

from mptrain.layers.moe.aux_loss import MoEAuxLossAutoScaler, set_aux_loss_scale
from mptrain.layers.moe.config import check_moe_config, is_moe, is_moe_layer, moe_layer_pattern
from mptrain.layers.moe.dispatcher import LocalDispatcher, TokenDispatcher, build_dispatcher
from mptrain.layers.moe.expert_bias import update_expert_bias
from mptrain.layers.moe.experts import GroupedMLP
from mptrain.layers.moe.layer import EXPERTS_KIND, MOE_KIND, ROUTER_KIND, MoELayer, moe_spec_kinds
from mptrain.layers.moe.router import TopKRouter
from mptrain.layers.moe.shared_experts import SharedExpertMLP
from mptrain.layers.moe.stats import RoutingStats

__all__ = ["MoEAuxLossAutoScaler", "set_aux_loss_scale", "check_moe_config", "is_moe", "is_moe_layer",
           "moe_layer_pattern", "LocalDispatcher", "TokenDispatcher", "build_dispatcher", "update_expert_bias",
           "GroupedMLP", "EXPERTS_KIND", "MOE_KIND", "ROUTER_KIND", "MoELayer", "moe_spec_kinds", "TopKRouter",
           "SharedExpertMLP", "RoutingStats"]
