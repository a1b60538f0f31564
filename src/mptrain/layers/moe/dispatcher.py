"""Token dispatchers: routed tokens to their experts' rows and back (Megatron-core
``megatron/core/transformer/moe/token_dispatcher.py``).

Legend: ``T`` tokens on this rank (``s/tp · b`` with sequence parallelism), ``E`` = num_moe_experts,
``E_local = E / ep`` experts on this rank (global experts ``[ep_rank·E_local, (ep_rank+1)·E_local)``),
``k`` = moe_router_topk, ``N`` rows handed to the experts.

`TokenDispatcher` is the interface every dispatcher follows (`LocalDispatcher` and, with the experts sharded
over the TP ranks, `ExpertTensorParallelDispatcher` here; the expert-parallel all-to-all / all-gather
dispatchers follow it too). `MoELayer` calls ``dispatch`` then ``combine`` once
per forward; a dispatcher may keep what ``combine`` needs between the two calls.

`LocalDispatcher` (EP = ETP = 1) only permutes. Rows are expert-major, each expert's tokens in token
order (Megatron's ``permute``: a stable sort of the transposed routing map). Each token's routed
experts, in expert order, are its slots ``0 .. k-1``; ``combine`` writes each row into its token's slot
of a ``[T, k, h]`` buffer (every slot written at most once: no atomic adds) and sums the slots, and the
backward of the permutation sums a token's k row grads the same way, so dispatch and combine are
deterministic on CUDA too (Megatron's scatter-add combine is not, without deterministic mode).
Dropless (no capacity factor): ``N = T·k``, static, no host sync. With a capacity factor: ``N`` = the
kept rows (one host read of their number), or with ``moe_pad_expert_input_to_capacity`` exactly
``E·capacity`` rows, each expert's kept tokens followed by zero rows of routing weight 0 (static shapes;
Megatron pads with other tokens at weight 0: the same outputs and grads).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from mptrain.layers.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_sequence_parallel_region_raw,
    reduce_scatter_to_sequence_parallel_region,
)
from mptrain.layers.moe.config import expert_capacity


class TokenDispatcher(Protocol):
    """Moves routed tokens to the ranks of their experts and back."""

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple:
        """hidden ``[T, h]``, probs ``[T, E]`` float (zeros off each token's routed experts), routing_map
        ``[T, E]`` bool -> ``(expert_input [N, h]`` grouped expert-major over the E_local local experts (all
        ETP ranks' tokens after the ETP all-gather), ``tokens_per_expert [E_local]`` int64 (on the host or the
        device; the experts read it on the host only for the per-expert loop), ``expert_probs [N]`` (each row's
        routing weight, applied by the experts: act(fc1(x)) · prob before fc2))."""

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """``[N, h]`` (probs already applied) -> ``[T, h]``: each token's expert outputs summed in token order."""


class _Permute(torch.autograd.Function):
    """``hidden[rows_token]`` whose backward sums each token's row grads through its slots (no atomics).

    forward(hidden ``[T, h]``, rows_token ``[N]`` (T for a padding row: a zero row), rows_slot ``[N]``
    (``t·k + slot``, or ``T·k`` for a padding row), k, padded) -> ``[N, h]``; backward: grads written into a
    ``[T·k + 1, h]`` buffer at rows_slot, the padding row dropped, the k slots of each token summed.
    """

    @staticmethod
    def forward(ctx, hidden, rows_token, rows_slot, k, padded):
        ctx.save_for_backward(rows_slot)
        ctx.tokens, ctx.k = hidden.shape[0], k
        if padded:
            hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])])
        return hidden.index_select(0, rows_token)

    @staticmethod
    def backward(ctx, grad):
        (rows_slot,) = ctx.saved_tensors
        t, k = ctx.tokens, ctx.k
        slots = grad.new_zeros(t * k + 1, grad.shape[-1]).index_copy_(0, rows_slot, grad)
        return slots[: t * k].view(t, k, -1).sum(dim=1), None, None, None, None


class LocalDispatcher:
    """The dispatcher of one expert-parallel rank (EP = ETP = 1): a permutation (module docstring).

    Args:
        num_experts: E. topk: k.
        capacity_factor: ``moe_expert_capacity_factor`` (None: dropless).
        pad_to_capacity: ``moe_pad_expert_input_to_capacity``.
    """

    def __init__(self, num_experts: int, topk: int, *, capacity_factor: Optional[float] = None,
                 pad_to_capacity: bool = False) -> None:
        self.num_experts, self.topk = num_experts, topk
        self.capacity_factor, self.pad_to_capacity = capacity_factor, pad_to_capacity
        self._rows_slot: Optional[torch.Tensor] = None
        self._tokens = 0

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple:
        t, k = routing_map.shape[0], self.topk
        # slot of (t, e): how many of t's routed experts precede e
        slot = routing_map.cumsum(dim=1) - 1  # [T, E]
        token_slot = torch.arange(t, device=routing_map.device).unsqueeze(1) * k + slot  # [T, E]
        if self.pad_to_capacity:
            rows_token, rows_slot, rows_flat, tokens_per_expert = self._padded_rows(routing_map, token_slot)
        else:
            n = t * k if self.capacity_factor is None else int(routing_map.sum())  # host read: kept rows (drops)
            # expert-major positions of the True entries, token order within an expert (stable sort)
            rows_flat = torch.argsort(routing_map.t().reshape(-1).to(torch.int8), descending=True, stable=True)[:n]
            rows_token = rows_flat % t
            rows_slot = token_slot.t().reshape(-1).index_select(0, rows_flat)
            tokens_per_expert = routing_map.sum(dim=0)
        self._rows_slot, self._tokens = rows_slot, t
        expert_input = _Permute.apply(hidden, rows_token, rows_slot, k, self.pad_to_capacity)
        probs_flat = torch.cat([probs.t().reshape(-1), probs.new_zeros(1)])  # the last entry: weight 0 for padding
        return expert_input, tokens_per_expert, probs_flat.index_select(0, rows_flat)

    def _padded_rows(self, routing_map: torch.Tensor, token_slot: torch.Tensor) -> tuple:
        """Rows of ``E · capacity``: expert e's kept tokens at ``e·capacity + rank``, then padding rows
        (token index T, a zero row; slot ``T·k``, dropped by combine; flat index ``E·T``, weight 0)."""
        t, e, k = routing_map.shape[0], self.num_experts, self.topk
        cap = min(expert_capacity(t, k, e, self.capacity_factor), t)  # Megatron pads to T when capacity > T
        dev = routing_map.device
        rank = routing_map.long().cumsum(dim=0) - 1  # [T, E] position among e's tokens
        row = torch.arange(e, device=dev) * cap + rank
        dummy = e * cap
        row = torch.where(routing_map & (rank < cap), row, torch.full_like(row, dummy)).t().reshape(-1)  # [E·T]
        flat = torch.arange(e * t, device=dev)
        rows_flat = torch.full((dummy + 1,), e * t, dtype=torch.long, device=dev).scatter_(0, row, flat)[:dummy]
        rows_token = torch.where(rows_flat < e * t, rows_flat % t, torch.full_like(rows_flat, t))
        slots = torch.cat([token_slot.t().reshape(-1), token_slot.new_full((1,), t * k)])
        tokens_per_expert = torch.full((e,), cap, dtype=torch.long, device=dev)
        return rows_token, slots.index_select(0, rows_flat), rows_flat, tokens_per_expert

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        t, k = self._tokens, self.topk
        rows_slot, self._rows_slot = self._rows_slot, None
        slots = expert_output.new_zeros(t * k + 1, expert_output.shape[-1]).index_copy(0, rows_slot, expert_output)
        return slots[: t * k].view(t, k, -1).sum(dim=1)


class ExpertTensorParallelDispatcher:
    """EP = 1 with the experts sharded over ETP = tp ranks under sequence parallelism: Megatron's all-gather
    dispatcher (``MoEAllGatherTokenDispatcher``) over the ETP group alone.

    dispatch: all-gather the ranks' ``[T/etp, h]`` tokens, probs and routing maps on the token dim (rank
    order = the sequence order: rank r holds sequence chunk r), then permute them all (`LocalDispatcher`): every
    ETP rank computes its f/etp slice of every expert for every token. combine: unpermute to ``[T, h]`` partial
    sums and reduce-scatter them back to ``[T/etp, h]``. Backward: the all-gathers reduce-scatter the grads (each
    rank's are partial over its slice), the reduce-scatter all-gathers them.

    Args:
        local: the permutation over the gathered tokens. group: the ETP process group.
    """

    def __init__(self, local: LocalDispatcher, group) -> None:
        self.local, self.group = local, group

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple:
        hidden = gather_from_sequence_parallel_region(hidden, self.group)  # [T, h]
        probs = gather_from_sequence_parallel_region(probs, self.group)  # [T, E]
        routing_map = gather_from_sequence_parallel_region_raw(routing_map.to(torch.uint8), self.group).bool()
        return self.local.dispatch(hidden, probs, routing_map)

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel_region(self.local.combine(expert_output), self.group)  # [T/etp, h]


def build_dispatcher(config, groups, *, num_local_experts: int, etp_size: int = 1) -> TokenDispatcher:
    """The token dispatcher of an MoE layer: `LocalDispatcher` on one expert-parallel rank with whole experts;
    `ExpertTensorParallelDispatcher` over the TP group when the experts are sharded over it (etp = tp > 1).

    Args:
        config: ModelConfig (num_moe_experts, moe_router_topk, moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity, moe_token_dispatcher_type).
        groups: `mptrain.groups.ParallelGroups`.
        num_local_experts: E_local. etp_size: the experts' tensor-parallel size.
    """
    assert num_local_experts == config.num_moe_experts, "expert parallelism needs its dispatcher"
    local = LocalDispatcher(config.num_moe_experts, config.moe_router_topk,
                            capacity_factor=config.moe_expert_capacity_factor,
                            pad_to_capacity=config.moe_pad_expert_input_to_capacity)
    if etp_size == 1:
        return local
    assert etp_size == groups.tp_size, "expert tensor parallelism other than tp needs its own group"
    return ExpertTensorParallelDispatcher(local, groups.tp_group)
