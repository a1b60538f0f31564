"""Token dispatchers: routed tokens to their experts' rows and back (Megatron-core
``megatron/core/transformer/moe/token_dispatcher.py``).

Legend: ``T`` tokens on this rank (``s/tp · b`` with sequence parallelism), ``E`` = num_moe_experts,
``E_local = E / ep`` experts on this rank (global experts ``[ep_rank·E_local, (ep_rank+1)·E_local)``),
``k`` = moe_router_topk, ``N`` rows handed to the experts.

`TokenDispatcher` is the interface every dispatcher follows: `LocalDispatcher` here, and the expert-parallel
`mptrain.layers.moe.dispatch_ep.AllToAllDispatcher` / ``AllGatherDispatcher`` (which also serve expert tensor
parallelism); `build_dispatcher` picks one from the groups' expert grid and ``model.moe_token_dispatcher_type``.
`MoELayer` calls ``dispatch`` then ``combine`` once per forward; a dispatcher may keep what ``combine`` needs
between the two calls.

`LocalDispatcher` (EP = ETP = 1) only permutes. Rows are expert-major, each expert's tokens in token
order (Megatron's ``permute``: a stable sort of the transposed routing map). Each token's routed
experts, in expert order, are its slots ``0 .. k-1``; ``combine`` sums each token's slots, every slot holding
at most one row (no atomic adds), and the backward of the permutation sums a token's k row grads the same way,
so dispatch and combine are deterministic on CUDA too (Megatron's scatter-add combine is not, without
deterministic mode). Dropless (no capacity factor): ``N = T·k``, static, no host sync; every slot holds a row,
so both sums gather the rows of a token's slots. ``dispatch_topk`` gives the same rows from the router's top-k
form (`mptrain.layers.moe.router.RoutesTopK`) by a stable sort of the ``T·k`` chosen experts, without the
``[T, E]`` map. With a capacity factor: ``N`` = the kept rows (one host read of their number; the sums write
the rows into a zeroed ``[T, k, h]`` buffer), or with ``moe_pad_expert_input_to_capacity`` exactly
``E·capacity`` rows, each expert's kept tokens followed by zero rows of routing weight 0 (static shapes;
Megatron pads with other tokens at weight 0: the same outputs and grads).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from mptrain.layers.moe.config import expert_capacity
from mptrain.layers.moe.dispatch_ep import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    Permutation,
    permute,
    permute_rows,
    permute_topk,
    unpermute,
)


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


class LocalDispatcher:
    """The dispatcher of one expert-parallel rank holding whole experts (EP = ETP = 1): a permutation (module
    docstring), `mptrain.layers.moe.dispatch_ep.permute` / ``unpermute`` plus the padding to capacity.

    Args:
        num_experts: E. topk: k.
        capacity_factor: ``moe_expert_capacity_factor`` (None: dropless).
        pad_to_capacity: ``moe_pad_expert_input_to_capacity``.
    """

    def __init__(self, num_experts: int, topk: int, *, capacity_factor: Optional[float] = None,
                 pad_to_capacity: bool = False) -> None:
        self.num_experts, self.topk = num_experts, topk
        self.capacity_factor, self.pad_to_capacity = capacity_factor, pad_to_capacity
        self._perm: Optional[Permutation] = None

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple:
        if self.pad_to_capacity:
            return self._dispatch_padded(hidden, probs, routing_map)
        t, k = routing_map.shape[0], self.topk
        n = t * k if self.capacity_factor is None else int(routing_map.sum())  # host read: kept rows (drops)
        rows, row_probs, self._perm = permute(hidden, routing_map, probs, num_out_tokens=n, slots=k)
        return rows, routing_map.sum(dim=0), row_probs

    def dispatch_topk(self, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> tuple:
        """`dispatch` from the router's top-k form (`mptrain.layers.moe.router.RoutesTopK`), dropless only: the same
        rows, counts and row weights (`mptrain.layers.moe.dispatch_ep.permute_topk`), without the ``[T, E]`` map.

        Args:
            hidden: ``[T, h]``. indices: ``[T, k]`` int64, each token's experts. weights: ``[T, k]``.
        Returns:
            ``(expert_input [T·k, h], tokens_per_expert [E]`` int64 on the device, ``expert_probs [T·k])``.
        """
        assert self.capacity_factor is None, "dispatch_topk is dropless"
        rows, row_probs, tokens_per_expert, self._perm = permute_topk(hidden, indices, weights,
                                                                      num_experts=self.num_experts)
        return rows, tokens_per_expert, row_probs

    def _dispatch_padded(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple:
        """``E · capacity`` rows: expert e's kept tokens at ``e·capacity + rank``, then padding rows (`Permutation`:
        token T, a zero row; slot T·k; weight 0). No host read: every size is known from T."""
        t, e, k = routing_map.shape[0], self.num_experts, self.topk
        cap = min(expert_capacity(t, k, e, self.capacity_factor), t)  # Megatron pads to T when capacity > T
        dev = routing_map.device
        rank = routing_map.long().cumsum(dim=0) - 1  # [T, E] position among e's tokens
        dummy = e * cap  # rows of dropped (t, e) entries land here, then are cut off
        row = torch.where(routing_map & (rank < cap), torch.arange(e, device=dev) * cap + rank,
                          torch.full_like(rank, dummy)).t().reshape(-1)  # [E·T], expert-major flat index
        flat = torch.full((dummy + 1,), e * t, dtype=torch.long, device=dev)
        flat = flat.scatter_(0, row, torch.arange(e * t, device=dev))[:dummy]  # row -> e·T + t, or E·T: padding
        rows_token = torch.where(flat < e * t, flat % t, torch.full_like(flat, t))
        token_slot = torch.arange(t, device=dev).unsqueeze(1) * k + routing_map.cumsum(dim=1) - 1  # [T, E]
        slots = torch.cat([token_slot.t().reshape(-1), token_slot.new_full((1,), t * k)]).index_select(0, flat)
        self._perm = Permutation(rows_token, slots, t, k, padded=True)
        rows = permute_rows(hidden, self._perm)
        row_probs = torch.cat([probs.t().reshape(-1), probs.new_zeros(1)]).index_select(0, flat)  # padding: 0
        return rows, torch.full((e,), cap, dtype=torch.long, device=dev), row_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        perm, self._perm = self._perm, None
        return unpermute(expert_output, perm)


def build_dispatcher(config, groups) -> TokenDispatcher:
    """The token dispatcher of an MoE layer: `LocalDispatcher` where this rank holds whole experts and routes only
    its own tokens to them (ep = etp = 1); else ``model.moe_token_dispatcher_type``'s
    (`mptrain.layers.moe.dispatch_ep.AllToAllDispatcher` / ``AllGatherDispatcher``) over the groups' expert grid.

    Args:
        config: ModelConfig (num_moe_experts, moe_router_topk, moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity, moe_token_dispatcher_type).
        groups: `mptrain.groups.ParallelGroups`.
    """
    e, k = config.num_moe_experts, config.moe_router_topk
    if groups.ep_size * groups.etp_size == 1:
        return LocalDispatcher(e, k, capacity_factor=config.moe_expert_capacity_factor,
                               pad_to_capacity=config.moe_pad_expert_input_to_capacity)
    kinds = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}  # closed: `check_moe_config`
    return kinds[config.moe_token_dispatcher_type](e, k, groups)
