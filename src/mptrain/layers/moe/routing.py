"""Top-k routing math: scores, the deterministic top-k, token dropping (pure tensor functions).

Legend: ``T`` tokens (this rank's ``s/tp · b`` rows, flattened sequence-major from ``[s, b, h]``), ``E``
experts, ``k`` = ``moe_router_topk``. Source: Megatron-core ``moe_utils.py``
(``topk_routing_with_score_function``, ``compute_routing_scores_for_aux_loss``, ``apply_router_token_dropping``).

Ties. ``torch.topk`` does not promise which of equal values it returns (CPU and CUDA differ, and so can
two CUDA kernels), so a routing decision between equal scores would depend on the device. Every choice
here is a stable sort instead: among equal scores the lower expert index wins (`topk_indices`); among
tokens of equal routing weight the earlier token wins (`drop_tokens`, policy ``probs``). Equal scores
occur in practice with identical tokens (padding, repeated ids) and identical router rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from mptrain.layers.moe.config import expert_capacity


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[T, k]`` of the k largest entries of each row of ``scores [T, E]``, largest first; ties go to
    the lower index (a stable descending sort; module docstring)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def topk_map(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, E]`` bool: True at each row's ``indices [T, k]`` (distinct per row). A comparison with the expert ids,
    not a scatter into zeros: one pointwise op that fuses with its consumer (a count over tokens) under Inductor."""
    experts = torch.arange(num_experts, device=indices.device)
    return (indices.unsqueeze(-1) == experts).any(dim=1)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: how many of the ``indices [T, k]`` name each expert (the tokens routed to it)."""
    experts = torch.arange(num_experts, device=indices.device)
    return (indices.reshape(-1, 1) == experts).sum(dim=0)


def routing_from_indices(logits: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> tuple:
    """``(probs [T, E], routing_map [T, E] bool)``: ``weights [T, k]`` placed at ``indices``, zeros elsewhere."""
    probs = torch.zeros_like(logits).scatter(1, indices, weights.to(logits.dtype))
    return probs, topk_map(indices, logits.shape[-1])


def topk_weights(logits: torch.Tensor, k: int, *, score_function: str, pre_softmax: bool,
                 scaling_factor: Optional[float], expert_bias: Optional[torch.Tensor]) -> tuple:
    """Route each token to k experts (Megatron's ``topk_routing_with_score_function``), in top-k form.

    - softmax, post (default): top-k on the logits, weights = softmax over the k chosen logits (sum 1);
    - softmax, ``pre_softmax``: softmax over all E, top-k, weights not renormalised;
    - sigmoid: per-expert sigmoid; the choice uses ``scores + expert_bias`` (aux-loss-free balancing), the
      weights the unbiased scores, divided by their sum when k > 1.
    Then ``scaling_factor`` multiplies the weights. Math in fp32.

    Args:
        logits: ``[T, E]`` gating output.
        expert_bias: ``[E]`` fp32 or None.
    Returns:
        ``(indices [T, k]`` int64, each token's experts, best first (`topk_indices`), ``weights [T, k]`` fp32).
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits.float(), dim=-1)
            indices = topk_indices(scores, k)
            weights = scores.gather(1, indices)
        else:
            indices = topk_indices(logits, k)
            weights = torch.softmax(logits.gather(1, indices).float(), dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
        choice = scores if expert_bias is None else scores + expert_bias
        indices = topk_indices(choice, k)
        weights = scores.gather(1, indices)
        if k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        weights = weights * scaling_factor
    return indices, weights


def scores_for_aux_loss(logits: torch.Tensor, k: int, score_function: str,
                        indices: Optional[torch.Tensor] = None) -> tuple:
    """``(routing_map [T, E] bool, scores [T, E] fp32)`` for the load-balancing loss: the full score
    distribution (softmax, or sigmoid normalised over E) and a fresh top-k on it, without expert bias
    (Megatron's ``compute_routing_scores_for_aux_loss``).

    ``indices``: the routing's top-k ``[T, k]`` where it was taken on these same scores (pre-softmax routing:
    `topk_weights` sorts ``softmax(logits.float())``), reused instead of a second sort. Not for post-softmax
    routing: its top-k is on the logits, and two logits that differ can round to equal softmax scores, a tie
    the scores' top-k breaks by the expert index, the logits' by the logits.
    """
    if score_function == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    if indices is None:
        indices = topk_indices(scores, k)
    return topk_map(indices, scores.shape[-1]), scores


def drop_tokens(probs: torch.Tensor, routing_map: torch.Tensor, *, topk: int, capacity_factor: float,
                policy: str) -> tuple:
    """Keep at most ``capacity = ceil(T·k/E · capacity_factor)`` tokens per expert
    (Megatron's ``apply_router_token_dropping`` without padding; padding is the dispatcher's).

    Policy ``probs``: an expert keeps its highest-weight tokens; ``position``: its earliest tokens (lowest
    row of the ``[T, E]`` map, i.e. sequence-major order of this rank's ``[s, b]``). Ties: the earlier token
    (module docstring).

    Returns:
        ``(probs, routing_map)`` with the dropped entries zeroed / False.
    """
    num_tokens, num_experts = routing_map.shape
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    if capacity >= num_tokens:  # nothing can exceed it
        return probs, routing_map
    if policy == "probs":
        # routed tokens rank above the others (-1), so an expert's own tokens always fill its capacity first
        key = torch.where(routing_map, probs.detach().float(), torch.full_like(probs, -1.0, dtype=torch.float32))
        kept = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]  # [capacity, E]
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    else:
        keep = routing_map.cumsum(dim=0) <= capacity  # the first `capacity` routed rows of each column
    routing_map = routing_map & keep
    return probs * routing_map, routing_map
