"""`TopKRouter`: the gate of an MoE layer (Megatron-core ``megatron/core/transformer/moe/router.py``).

Legend: input ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism: each TP rank routes its own
sequence shard), ``T = s·b`` (or ``s/tp·b``) tokens flattened sequence-major, ``E`` experts, top-``k``.

forward: jitter (training) -> logits = x Wᵀ ``[T, E]`` (in ``moe_router_dtype``) -> z-loss attached to the
logits -> top-k routing (`mptrain.layers.moe.routing.topk_weights`: each token's k experts and weights) -> aux
losses attached to the weights -> the ``[T, E]`` probs and routing map -> capacity dropping -> expert-bias counts
and routing statistics. `TopKRouter.route` hands out the same decision in top-k form (dropless: no capacity),
for the dispatcher that permutes from it (`RoutesTopK`). The aux losses, the counts and the
statistics are taken only in training with grad enabled: under full recomputation the first forward runs
without grad and its replay in backward with it, so each micro-batch counts once (Megatron's rule).

State besides the weight ``[E, h]`` (named ``decoder.layers.<n>.mlp.router.weight``): with
``moe_router_enable_expert_bias`` the persistent fp32 buffer ``expert_bias [E]`` (saved in checkpoints) and
``local_tokens_per_expert [E]`` (this step's counts, consumed by `mptrain.layers.moe.expert_bias`);
``routing_stats`` (`ROUTING_STATS_FIELDS`, read and reset by `mptrain.layers.moe.stats`); the aux-loss
backward scale (`set_aux_loss_scale`). They stay fp32 when a wrapper casts the model (`_apply`).
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from mptrain.layers.context import LayerContext
from mptrain.layers.moe.aux_loss import MoEAuxLossAutoScaler, switch_load_balancing_loss, z_loss
from mptrain.layers.moe.routing import (
    drop_tokens,
    expert_counts,
    routing_from_indices,
    scores_for_aux_loss,
    topk_weights,
)
from mptrain.layers.sharding import ShardSpec

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
"""``model.moe_router_dtype`` -> the gating GEMM's dtype (None: the input's)."""


def routing_stats_size(num_experts: int) -> int:
    """Length of a router's ``routing_stats``: E token counts, then dropped, aux loss / coeff, z-loss / coeff."""
    return num_experts + 3


class TopKRouter(torch.nn.Module):
    """Routes each token to its top-k experts; the default ``router`` node of the MoE spec.

    Args:
        config: ModelConfig (num_moe_experts, moe_router_*, moe_aux_loss_coeff, moe_z_loss_coeff,
            moe_expert_capacity_factor, moe_token_drop_policy, moe_input_jitter_eps, init_method_std).
        context: `LayerContext` (groups: the TP group sums aux-loss counts under SP; init; dtype; device).
        layer_number: global 0-based layer index (names ``decoder.layers.<n>.mlp.router.weight``).
    forward(x ``[s, b, h]``) -> ``(probs [T, E]`` (zeros off each token's routed experts; dtype of the
    logits), ``routing_map [T, E]`` bool).
    """

    def __init__(self, config, context: LayerContext, *, layer_number: int) -> None:
        super().__init__()
        e, h = config.num_moe_experts, config.hidden_size
        self.layer_number, self.num_experts, self.topk = layer_number, e, config.moe_router_topk
        self.config = config
        self.groups, self.sequence_parallel = context.groups, context.sequence_parallel
        self.router_dtype = ROUTER_DTYPES[config.moe_router_dtype]
        device = context.device
        w = context.init.normal(f"decoder.layers.{layer_number}.mlp.router.weight", (e, h))
        self.weight = torch.nn.Parameter(w.to(device=device, dtype=context.params_dtype))
        fp32 = dict(dtype=torch.float32, device=device)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, **fp32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(e, **fp32), persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        self.register_buffer("routing_stats", torch.zeros(routing_stats_size(e), **fp32), persistent=False)
        self.register_buffer("aux_loss_scale", torch.ones((), **fp32), persistent=False)
        self._scale_value = 1.0

    def local_shard_specs(self) -> dict:
        # replicated over TP; under SP each rank routed its own tokens, so the grad is summed over TP
        return {"weight": ShardSpec(global_shape=tuple(self.weight.shape), sequence_parallel_grad=self.sequence_parallel)}

    def _apply(self, fn, recurse: bool = True):
        """Wrappers cast the model (``Float16Module``: ``.to(bf16)``); the buffers keep fp32 (the bias and the
        counts must not round, Megatron's ``_maintain_float32_expert_bias``) and only follow the device."""
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            self._buffers[name] = buf.to(device=self._buffers[name].device)
        return self

    def set_aux_loss_scale(self, scale: float) -> None:
        """`mptrain.layers.moe.aux_loss.UsesAuxLossScale`: the backward scale of the aux and z losses."""
        if scale != self._scale_value:  # a fill per change, not per step
            self.aux_loss_scale.fill_(scale)
            self._scale_value = scale

    def _counting(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _tp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over TP under sequence parallelism (the ranks routed different tokens); as is otherwise."""
        if self.sequence_parallel:
            torch.distributed.all_reduce(t, group=self.groups.tp_group)
        return t

    def _with_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.moe_z_loss_coeff
        if not coeff or not self._counting():
            return logits
        tp = self.groups.tp_size if self.sequence_parallel else 1
        loss = z_loss(logits, coeff / tp)  # the TP ranks' terms average the micro-batch's
        self.routing_stats[-1] += loss.detach() / coeff
        return MoEAuxLossAutoScaler.apply(logits, loss, self.aux_loss_scale)

    def _with_aux_loss(self, weights: torch.Tensor, logits: torch.Tensor, seq_length: int,
                       indices: torch.Tensor) -> torch.Tensor:
        """``weights [T, k]`` with the load-balancing loss attached (its grad joins in backward)."""
        kind, coeff = self.config.moe_router_load_balancing_type, self.config.moe_aux_loss_coeff
        if kind == "none" or not coeff or not self._counting():
            return weights
        cfg = self.config
        # pre-softmax routing took its top-k on the very scores the loss counts: no second sort
        same = cfg.moe_router_score_function == "softmax" and cfg.moe_router_pre_softmax
        routing_map, scores = scores_for_aux_loss(logits, self.topk, cfg.moe_router_score_function,
                                                  indices if same else None)
        tp = self.groups.tp_size if self.sequence_parallel else 1
        batch = 1
        if kind == "seq_aux_loss":  # one column block per sequence: [s·b, E] -> [s, b·E]
            batch = logits.shape[0] // seq_length
            routing_map, scores = routing_map.reshape(seq_length, -1), scores.reshape(seq_length, -1)
        counts = self._tp_sum(routing_map.sum(dim=0).float())
        total = routing_map.shape[0] * tp
        loss = switch_load_balancing_loss(scores, counts, total_tokens=total, topk=self.topk,
                                          num_experts=self.num_experts, coeff=coeff) / batch
        self.routing_stats[-2] += loss.detach() / coeff
        return MoEAuxLossAutoScaler.apply(weights, loss, self.aux_loss_scale)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """logits ``[T, E]`` = x Wᵀ in ``moe_router_dtype`` (the input's dtype when null). x ``[T, h]``."""
        dtype = self.router_dtype or x.dtype
        return F.linear(x.to(dtype), self.weight.to(dtype))

    def _topk(self, x: torch.Tensor) -> tuple:
        """``(logits [T, E], indices [T, k], weights [T, k])`` in the logits' dtype, the z and aux losses attached."""
        seq_length, h = x.shape[0], x.shape[-1]
        tokens = x.reshape(-1, h)  # [T, h], sequence-major
        eps = self.config.moe_input_jitter_eps
        if eps and self.training:  # Switch Transformer's multiplicative jitter, training only
            tokens = tokens * torch.empty_like(tokens).uniform_(1.0 - eps, 1.0 + eps)
        logits = self._with_z_loss(self.gating(tokens))
        cfg = self.config
        indices, weights = topk_weights(logits, self.topk, score_function=cfg.moe_router_score_function,
                                        pre_softmax=cfg.moe_router_pre_softmax,
                                        scaling_factor=cfg.moe_router_topk_scaling_factor,
                                        expert_bias=self.expert_bias)
        # attached to the weights every routed form derives from: the loss's grad flows wherever they are used
        weights = self._with_aux_loss(weights.to(logits.dtype), logits, seq_length, indices)
        return logits, indices, weights

    def forward(self, x: torch.Tensor) -> tuple:
        logits, indices, weights = self._topk(x)
        probs, routing_map = routing_from_indices(logits, indices, weights)
        selected = routing_map
        cfg = self.config
        if cfg.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_tokens(probs, routing_map, topk=self.topk,
                                             capacity_factor=cfg.moe_expert_capacity_factor,
                                             policy=cfg.moe_token_drop_policy)
        if self._counting():
            self._count(selected.sum(dim=0, dtype=torch.float32), routing_map.sum(dim=0, dtype=torch.float32))
        return probs, routing_map

    def route(self, x: torch.Tensor) -> tuple:
        """The decision of `forward` in top-k form, for a dropless dispatcher (`RoutesTopK`).

        Returns:
            ``(indices [T, k]`` int64, each token's experts, best first (ties: the lower index), ``weights [T, k]``
            their routing weights, in the logits' dtype).
        Raises:
            ValueError: with ``model.moe_expert_capacity_factor`` set (dropping needs the ``[T, E]`` form).
        """
        if self.config.moe_expert_capacity_factor is not None:
            raise ValueError("TopKRouter.route is dropless; with model.moe_expert_capacity_factor use forward")
        _, indices, weights = self._topk(x)
        if self._counting():
            self._count(expert_counts(indices, self.num_experts).float())
        return indices, weights

    @torch.no_grad()
    def _count(self, chosen: torch.Tensor, kept: Optional[torch.Tensor] = None) -> None:
        """Per micro-batch: the tokens each expert was chosen by (before dropping, ``chosen [E]``) and the dropped
        ones into ``routing_stats``; the dispatched ones (``kept [E]``; None: dropless, all of ``chosen``) into
        ``local_tokens_per_expert`` (expert bias)."""
        self.routing_stats[: self.num_experts] += chosen
        if kept is not None:
            self.routing_stats[self.num_experts] += chosen.sum() - kept.sum()
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert += chosen if kept is None else kept


@runtime_checkable
class RoutesTopK(Protocol):
    """A router that also hands out its decision in top-k form (`TopKRouter.route`): ``route(x [s, b, h]) ->
    (indices [T, k], weights [T, k])``, the same experts and weights as its ``forward``'s ``[T, E]`` form, before
    capacity dropping. `mptrain.layers.moe.MoELayer` routes through it to a dispatcher that permutes from the
    top-k form (`mptrain.layers.moe.dispatcher.LocalDispatcher.dispatch_topk`, dropless), which skips the
    ``[T, E]`` scatters and the sort over ``E·T`` map entries."""

    def route(self, x: torch.Tensor) -> tuple: ...
