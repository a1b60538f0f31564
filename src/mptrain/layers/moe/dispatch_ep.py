"""Expert-parallel token dispatchers: routed tokens to the ranks of their experts and back.

Legend: T = tokens on this rank (``[T, h]``, the ``[s/tp·b, h]`` rows of a micro-batch under sequence
parallelism), E = experts of the layer (``model.num_moe_experts``), k = experts per token, ep / etp =
expert-model / expert-tensor parallel sizes, E_local = E / ep experts on this rank: global experts
``[ep_rank·E_local, (ep_rank+1)·E_local)``. N = rows reaching this rank's experts, grouped expert-major.

Both dispatchers implement the `TokenDispatcher` protocol (``dispatch(hidden [T, h], probs [T, E],
routing_map [T, E] bool) -> (expert_input [N, h], tokens_per_expert [E_local] int64 on the host,
expert_probs [N])`` and ``combine(expert_output [N, h]) -> [T, h]``) over the groups object's expert
grid: the experts' outputs carry their routing prob already (the experts apply ``expert_probs``), and
``combine`` sums each token's k outputs back into token order. Under expert tensor parallelism each ETP
rank's expert output is a partial sum over its FFN shard; ``combine`` reduces it. Capacity (token
dropping) happens in the router, before dispatch: the routing map is taken as given.

- `AllToAllDispatcher` (Megatron-core ``MoEAlltoAllTokenDispatcher``): each rank permutes its own
  tokens expert-major and sends each EP peer only the rows its experts need (variable all-to-all over
  EP), then all-gathers them over ETP. Traffic ∝ k·T·h per rank.
- `AllGatherDispatcher` (``MoEAllGatherTokenDispatcher``): every rank of the etp × ep group gathers all
  the group's tokens and keeps the rows of its experts; combine reduce-scatters. Traffic ∝ etp·ep·T·h
  per rank; simple, and good for small ep or large k.

Split sizes of the collectives are host integers, so each dispatch reads the token counts to the
host once (Megatron does the same; its CUDA path does it on a side stream). A token's rows are summed
through its k slots (every slot written once) in combine and in the permutation's backward, instead of
Megatron's scatter-add: no atomic adds, so the result does not depend on the order of arrival on CUDA.

Source: NVIDIA/Megatron-LM ``megatron/core/transformer/moe/token_dispatcher.py``, ``moe_utils.py``
(``permute``, ``unpermute``, ``sort_chunks_by_idxs``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mptrain.groups import ParallelGroups, check_num_experts
from mptrain.layers.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    gather_from_sequence_parallel_region_raw,
    reduce_scatter_to_sequence_parallel_region,
)
from mptrain.layers.moe.routing import expert_counts


# --- local permutation (no communication) -----------------------------------------------------
@dataclasses.dataclass
class Permutation:
    """Where the permuted rows come from: row i is token ``rows_token[i]``'s routed expert number
    ``rows_slot[i] - k·rows_token[i]`` (its experts counted in expert order), k = ``slots``. With ``padded``
    (experts padded to their capacity, `mptrain.layers.moe.dispatcher.LocalDispatcher`) a padding row has
    ``rows_token`` T (a zero row) and ``rows_slot`` T·k (a slot that `unpermute` drops). ``slot_rows``: the
    inverse, the row of each slot, where every slot has one (N = T·k, dropless); the sums over a token's slots
    then gather their rows instead of writing them into a zeroed ``[T·k, h]`` buffer."""

    rows_token: torch.Tensor  # [N] int64
    rows_slot: torch.Tensor  # [N] int64, t·k + slot
    num_tokens: int  # T
    slots: int  # k: the most rows a token has
    padded: bool = False
    slot_rows: Optional[torch.Tensor] = None  # [T·k] int64 (N = T·k), the row at each slot t·k + j


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse[order[i]] = i`` for a permutation ``order [n]`` of ``0 .. n-1`` (one scatter, no sort)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


def _sum_slots(x: torch.Tensor, num_tokens: int, slots: int) -> torch.Tensor:
    """``[T·k, ...]`` slot-major rows -> ``[T, ...]``: each token's k slots summed (in slot order)."""
    if slots == 1:
        return x
    return x.view((num_tokens, slots) + tuple(x.shape[1:])).sum(dim=1)


class PermuteRows(torch.autograd.Function):
    """``hidden[rows_token]``; backward sums each token's row grads through its slots (every slot holds at most one
    row, so no atomic adds: deterministic on CUDA too). ``index``: the rows' slots (``rows_slot``: backward writes
    the grads into a zeroed ``[T·k, h]`` buffer), or with ``gather`` each slot's row (``slot_rows``, every slot
    holding one: backward gathers them). ``padded``: index T is a zero row and slot T·k a dropped one
    (`Permutation`)."""

    @staticmethod
    def forward(ctx, hidden, rows_token, index, slots, padded=False, gather=False):
        ctx.save_for_backward(index)
        ctx.num_tokens, ctx.slots, ctx.padded, ctx.gather = hidden.shape[0], slots, padded, gather
        if padded:
            hidden = torch.cat([hidden, hidden.new_zeros((1,) + tuple(hidden.shape[1:]))])
        return hidden.index_select(0, rows_token)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        t, k = ctx.num_tokens, ctx.slots
        if ctx.gather:
            return _sum_slots(grad.index_select(0, index), t, k), None, None, None, None, None
        buffer = grad.new_zeros((t * k + int(ctx.padded),) + tuple(grad.shape[1:])).index_copy_(0, index, grad)
        return buffer[: t * k].view((t, k) + tuple(grad.shape[1:])).sum(dim=1), None, None, None, None, None


def permute_rows(hidden: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """``hidden [T, h]`` -> its rows ``[N, h]`` in ``perm``'s order (`PermuteRows`, gathering in backward where
    ``perm.slot_rows`` is set)."""
    if perm.slot_rows is not None:
        return PermuteRows.apply(hidden, perm.rows_token, perm.slot_rows, perm.slots, perm.padded, True)
    return PermuteRows.apply(hidden, perm.rows_token, perm.rows_slot, perm.slots, perm.padded)


class UnpermuteRows(torch.autograd.Function):
    """Each token's rows summed through its slots, every slot holding one row (N = T·k): ``rows[slot_rows]`` summed
    over the k slots, one gather; backward: each row gets its token's grad, ``grad[rows_token]``."""

    @staticmethod
    def forward(ctx, rows, slot_rows, rows_token, slots):
        ctx.save_for_backward(rows_token)
        return _sum_slots(rows.index_select(0, slot_rows), rows.shape[0] // slots, slots)

    @staticmethod
    def backward(ctx, grad):
        (rows_token,) = ctx.saved_tensors
        return grad.index_select(0, rows_token), None, None, None


def permute(hidden: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, *, num_out_tokens: int,
            slots: int) -> tuple[torch.Tensor, torch.Tensor, Permutation]:
    """Rows grouped by expert (expert-major, tokens in order within an expert; Megatron ``moe_utils.permute``).

    Args:
        hidden: ``[T, h]``.
        routing_map: ``[T, E']`` bool, True where a token goes to an expert; at most ``slots`` per token.
        probs: ``[T, E']``.
        num_out_tokens: N, the number of True entries (a host int: sizes the result without a device sync).
        slots: k, the most True entries of a token (``moe_router_topk``; fewer after capacity dropping).
    Returns:
        (rows ``[N, h]``, their probs ``[N]``, the `Permutation` that `unpermute` reverses).
    """
    num_tokens = routing_map.shape[0]
    # expert-major flat index e·T + t of every True entry, in order: a stable sort puts the Trues first
    flat = routing_map.T.reshape(-1).to(torch.int8).argsort(descending=True, stable=True)[:num_out_tokens]
    rows_token = flat % num_tokens
    # slot of (t, e): how many of t's routed experts precede e
    token_slot = torch.arange(num_tokens, device=hidden.device).unsqueeze(1) * slots + routing_map.cumsum(dim=1) - 1
    rows_slot = token_slot.T.reshape(-1).index_select(0, flat)
    full = num_out_tokens == num_tokens * slots  # every token has all its slots: the sums gather
    perm = Permutation(rows_token, rows_slot, num_tokens, slots,
                       slot_rows=inverse_permutation(rows_slot) if full else None)
    rows = permute_rows(hidden, perm)
    return rows, probs.T.reshape(-1).index_select(0, flat), perm


def permute_topk(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, *,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Permutation]:
    """`permute` from each token's top-k experts (dropless), without the ``[T, E]`` map: the same rows in the same
    order, the same slots.

    The pairs ``t·k + j`` (token t's j-th expert) sorted stably by expert are the rows: expert-major, tokens in
    order within an expert (a token has an expert once). A pair's slot is ``t·k`` + how many of t's experts are
    below its own (`permute`'s expert order of a token's slots), a comparison within the token; its inverse,
    ``slot_rows``, makes both sums over a token's slots (combine, the permutation's backward) and the weights'
    backward gathers.

    Args:
        hidden: ``[T, h]``.
        indices: ``[T, k]`` int64, each token's k distinct experts in any order (`TopKRouter.route`: best first).
        weights: ``[T, k]``, their routing weights.
        num_experts: E.
    Returns:
        (rows ``[T·k, h]``, their weights ``[T·k]``, tokens_per_expert ``[E]`` int64 on the device, the `Permutation`).
    """
    num_tokens, k = indices.shape
    pair_experts = indices.reshape(-1)  # [T·k]
    key = pair_experts.to(torch.int8 if num_experts <= 128 else torch.int32)  # a narrow key: fewer radix-sort passes
    row_pairs = key.argsort(stable=True)  # [T·k]: the pair of each row
    below = (indices.unsqueeze(1) < indices.unsqueeze(2)).sum(dim=2)  # [T, k]: the token's experts below each one
    pair_slots = (torch.arange(num_tokens, device=indices.device).unsqueeze(1) * k + below).reshape(-1)  # [T·k]
    rows_slot = pair_slots.index_select(0, row_pairs)
    slot_rows = inverse_permutation(rows_slot)
    perm = Permutation(row_pairs.div(k, rounding_mode="floor"), rows_slot, num_tokens, k, slot_rows=slot_rows)
    rows = permute_rows(hidden, perm)
    pair_rows = slot_rows.index_select(0, pair_slots)  # the row of each pair (the inverse of row_pairs)
    row_weights = PermuteRows.apply(weights.reshape(-1), row_pairs, pair_rows, 1, False, True)  # one row per pair
    return rows, row_weights, expert_counts(indices, num_experts), perm


def unpermute(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """``[N, h]`` -> ``[T, h]``: each token's rows summed (Megatron ``moe_utils.unpermute`` without merging
    probs, which the experts applied), through its slots: every slot written once, no atomic adds; gathered
    where every slot has a row (``perm.slot_rows``)."""
    t, k, width = perm.num_tokens, perm.slots, tuple(rows.shape[1:])
    if perm.slot_rows is not None:
        return UnpermuteRows.apply(rows, perm.slot_rows, perm.rows_token, k)
    buffer = rows.new_zeros((t * k + int(perm.padded),) + width).index_copy(0, perm.rows_slot, rows)
    return buffer[: t * k].view((t, k) + width).sum(dim=1)


def sort_chunks(x: torch.Tensor, split_sizes: list, order: list) -> torch.Tensor:
    """Dim-0 chunks of ``split_sizes`` rows, concatenated in ``order`` (Megatron ``sort_chunks_by_idxs``)."""
    chunks = x.split(split_sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


def _check_inputs(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, num_experts: int) -> None:
    if hidden.dim() != 2 or probs.shape != routing_map.shape or tuple(routing_map.shape) != (hidden.shape[0], num_experts):
        raise ValueError(f"dispatch: expected hidden [T, h], probs and routing_map [T, {num_experts}]; got "
                         f"{tuple(hidden.shape)}, {tuple(probs.shape)}, {tuple(routing_map.shape)}")
    if routing_map.dtype != torch.bool:
        raise ValueError(f"dispatch: routing_map must be bool, got {routing_map.dtype}")


class ExpertGridDispatcher:
    """What both expert-parallel dispatchers hold: E, k, the groups, this rank's local experts
    ``[first_expert, first_expert + num_local_experts)``, and the state ``dispatch`` leaves for the ``combine``
    that reverses it (`_take_state`).

    Args:
        num_moe_experts: E.
        topk: k (``moe_router_topk``), the most experts a token is routed to.
        groups: the `ParallelGroups` (its expert grid).
    Raises:
        ConfigError: E not divisible by ep.
    """

    def __init__(self, num_moe_experts: int, topk: int, groups: ParallelGroups) -> None:
        check_num_experts(num_moe_experts, groups.ep_size)
        self.num_experts, self.topk = num_moe_experts, topk
        self.groups = groups
        self.num_local_experts = num_moe_experts // groups.ep_size
        self.first_expert = groups.ep_rank * self.num_local_experts
        self._state = None

    def _take_state(self):
        """The state of the last ``dispatch``, once (the next ``combine`` needs a new dispatch).

        Raises:
            RuntimeError: no dispatch since the last combine.
        """
        st, self._state = self._state, None
        if st is None:
            raise RuntimeError("combine() needs the dispatch() it reverses")
        return st


# --- all-to-all ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _AllToAllState:
    """What `AllToAllDispatcher.combine` needs from the dispatch it reverses."""

    perm: Permutation
    input_splits: list  # [ep] rows this rank sent to each EP rank
    output_splits: list  # [ep] rows this rank received from each EP rank (same ETP rank)
    etp_splits: list  # [etp] rows each ETP rank received over EP, gathered here
    chunk_sizes: list  # [(etp·ep)·E_local] rows per (source etp, source ep, local expert), that order
    probs_dtype: torch.dtype


class AllToAllDispatcher(ExpertGridDispatcher):
    """Variable all-to-all over EP, then all-gather over ETP (Megatron ``MoEAlltoAllTokenDispatcher``).

    dispatch: (1) per-expert counts of this rank ``[E]``, all-gathered over etp × ep -> ``[etp, ep, E]``
    (one host read): ``input_splits[j]`` = rows for EP rank j's experts, ``output_splits[j]`` = rows EP
    rank j sends here, ``etp_splits[t]`` = rows ETP rank t received; (2) permute the T tokens
    expert-major (k rows each); (3) all-to-all over EP (rows and their probs); (4) all-gather over ETP
    (every ETP shard of an expert sees all its rows); (5) with several local experts, reorder the
    ``[source etp, source ep, local expert]`` chunks to ``[local expert, source etp, source ep]``.
    combine mirrors it: reorder back, reduce-scatter over ETP (sums the ETP partial outputs, in the
    probs' dtype as Megatron), all-to-all back over EP, and add each row into its token.

    Arguments as `ExpertGridDispatcher`'s; it uses the groups' ``ep_group``, ``etp_group``, ``tp_ep_group`` and ranks.
    """

    def _splits(self, routing_map: torch.Tensor) -> tuple[list, list, list, list, list]:
        """(own counts [E], input_splits [ep], output_splits [ep], etp_splits [etp], chunk_sizes) as host ints."""
        g, E, E_local = self.groups, self.num_experts, self.num_local_experts
        ep, etp = g.ep_size, g.etp_size
        counts = routing_map.sum(dim=0).to(torch.int64)  # [E]
        # tp_ep group ranks are ordered etp fastest: [ep, etp, E] -> [etp, ep, E]
        gathered = counts.unsqueeze(0)
        if ep * etp > 1:
            gathered = gather_from_sequence_parallel_region_raw(gathered, g.tp_ep_group)
        every = gathered.view(ep, etp, E).transpose(0, 1).tolist()  # host sync: split sizes are host ints
        own = every[g.etp_rank][g.ep_rank]
        input_splits = [sum(own[j * E_local:(j + 1) * E_local]) for j in range(ep)]
        lo, hi = self.first_expert, self.first_expert + E_local
        to_here = [[every[t][j][lo:hi] for j in range(ep)] for t in range(etp)]  # [etp][ep][E_local]
        output_splits = [sum(c) for c in to_here[g.etp_rank]]
        etp_splits = [sum(sum(c) for c in to_here[t]) for t in range(etp)]
        chunk_sizes = [n for t in range(etp) for j in range(ep) for n in to_here[t][j]]
        return own, input_splits, output_splits, etp_splits, chunk_sizes

    def _expert_major(self) -> list:
        """Chunk order [local expert][source]: chunk s·E_local + e of the [source][local expert] layout."""
        sources = self.groups.etp_size * self.groups.ep_size
        return [s * self.num_local_experts + e for e in range(self.num_local_experts) for s in range(sources)]

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden [T, h]``, ``probs [T, E]``, ``routing_map [T, E]`` bool -> (expert_input ``[N, h]`` grouped by
        local expert, tokens_per_expert ``[E_local]`` int64 on the host, expert_probs ``[N]``)."""
        _check_inputs(hidden, probs, routing_map, self.num_experts)
        g = self.groups
        own, input_splits, output_splits, etp_splits, chunk_sizes = self._splits(routing_map)
        rows, row_probs, perm = permute(hidden, routing_map, probs, num_out_tokens=sum(own), slots=self.topk)
        rows = all_to_all(rows, g.ep_group, output_split_sizes=output_splits, input_split_sizes=input_splits)
        row_probs = all_to_all(row_probs, g.ep_group, output_split_sizes=output_splits, input_split_sizes=input_splits)
        # every ETP shard of an expert computes on all its rows; the grads are partial over ETP: reduce-scatter
        rows = gather_from_sequence_parallel_region(rows, g.etp_group, output_split_sizes=etp_splits)
        row_probs = gather_from_sequence_parallel_region(row_probs, g.etp_group, output_split_sizes=etp_splits)
        order = self._expert_major()
        if self.num_local_experts > 1:
            rows = sort_chunks(rows, chunk_sizes, order)
            row_probs = sort_chunks(row_probs, chunk_sizes, order)
        tokens_per_expert = torch.tensor(chunk_sizes, dtype=torch.int64).view(-1, self.num_local_experts).sum(0)
        self._state = _AllToAllState(perm, input_splits, output_splits, etp_splits, chunk_sizes, probs.dtype)
        return rows, tokens_per_expert, row_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """``[N, h]`` expert outputs (probs applied; partial sums under ETP) -> ``[T, h]``, each token's k rows summed.

        Raises:
            RuntimeError: called without a dispatch before it.
        """
        st: _AllToAllState = self._take_state()
        g = self.groups
        y = expert_output
        if self.num_local_experts > 1:
            order = self._expert_major()
            inverse = sorted(range(len(order)), key=order.__getitem__)
            y = sort_chunks(y, [st.chunk_sizes[i] for i in order], inverse)
        if g.etp_size > 1:
            y = reduce_scatter_to_sequence_parallel_region(y.to(st.probs_dtype), g.etp_group,
                                                           input_split_sizes=st.etp_splits).to(expert_output.dtype)
        y = all_to_all(y, g.ep_group, output_split_sizes=st.input_splits, input_split_sizes=st.output_splits)
        return unpermute(y, st.perm)


# --- all-gather ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _AllGatherState:
    perm: Permutation  # over the P·T gathered tokens
    probs_dtype: torch.dtype


class AllGatherDispatcher(ExpertGridDispatcher):
    """All-gather over etp × ep, keep the local experts' rows (Megatron ``MoEAllGatherTokenDispatcher``).

    dispatch: all-gather hidden ``[T, h] -> [P·T, h]``, probs and the routing map over the tp_ep group
    (P = etp · ep ranks, each with the same T: one micro-batch shape), keep the columns of the local
    experts and permute those rows expert-major. combine: add the rows into the P·T gathered tokens,
    then reduce-scatter back to ``[T, h]`` (summing the other experts' ranks and the ETP partial sums;
    in the probs' dtype as Megatron).

    Arguments as `ExpertGridDispatcher`'s; it uses the groups' ``tp_ep_group``.
    """

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `AllToAllDispatcher.dispatch`; rows within an expert are in (source rank, token) order."""
        _check_inputs(hidden, probs, routing_map, self.num_experts)
        group = self.groups.tp_ep_group
        if self.groups.etp_size * self.groups.ep_size > 1:
            routing_map = gather_from_sequence_parallel_region_raw(routing_map, group)
            # each rank's grads cover its own experts' columns / rows: partial sums, reduce-scattered back
            probs = gather_from_sequence_parallel_region(probs, group)
            hidden = gather_from_sequence_parallel_region(hidden, group)
        lo, hi = self.first_expert, self.first_expert + self.num_local_experts
        local_map = routing_map[:, lo:hi]
        tokens_per_expert = local_map.sum(dim=0).to(device="cpu", dtype=torch.int64)  # host sync: the row count
        rows, row_probs, perm = permute(hidden, local_map, probs[:, lo:hi], num_out_tokens=int(tokens_per_expert.sum()),
                                        slots=min(self.topk, self.num_local_experts))
        self._state = _AllGatherState(perm, probs.dtype)
        return rows, tokens_per_expert, row_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """As `AllToAllDispatcher.combine`.

        Raises:
            RuntimeError: called without a dispatch before it.
        """
        st: _AllGatherState = self._take_state()
        y = unpermute(expert_output, st.perm)
        if self.groups.etp_size * self.groups.ep_size > 1:
            y = reduce_scatter_to_sequence_parallel_region(y.to(st.probs_dtype), self.groups.tp_ep_group)
        return y.to(expert_output.dtype)


__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "ExpertGridDispatcher", "Permutation", "PermuteRows",
           "UnpermuteRows", "inverse_permutation", "permute", "permute_rows", "permute_topk", "sort_chunks", "unpermute"]
