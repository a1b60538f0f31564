"""Context parallelism's sequence layout: which tokens a CP rank holds, and the rules of the keys.

Causal attention work grows with position, so each sequence of ``s`` tokens is cut into ``2·cp`` equal
chunks and CP rank r keeps chunks r and 2·cp − 1 − r (cp = 2: rank 0 holds chunks {0, 3}, rank 1 holds
{1, 2}); every rank then does the same attention work (Megatron ``megatron/core/utils.py``
``get_batch_on_this_cp_rank``; PyTorch's ``_HeadTailLoadBalancer``). Every tensor with a sequence dim
(tokens, labels, loss mask, position ids, the rows of a dense attention mask) is sliced alike; labels are
shifted on the whole sequence before, so no chunk needs its neighbour's tokens. RoPE angles are those of
the global positions of the two chunks (`local_positions`). Document offsets (``cu_seqlens``,
``data.reset_attention_mask``) stay whole on every CP rank: they describe the whole sequence, which the CP
attention's blocks index by global position (`cp_blocks`).
"""

from __future__ import annotations

from typing import Optional

import torch

from mptrain.errors import ConfigError, check_choice

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
"""``parallel.cp_comm_type``: the ring (Megatron's default), one all-gather of K/V, or all-to-all over heads (Ulysses)."""


def check_context_parallel(parallel, model, data=None) -> None:
    """The ``parallel.context_parallel_size`` / ``parallel.cp_comm_type`` rules (before any collective).

    Raises:
        ConfigError: cp below 1; an unknown cp_comm_type; a model.seq_length that 2·cp does not divide (or,
            under sequence parallelism, whose s/cp tp does not divide);
            cp > 1 with an MoE model (its aux-loss and dispatch statistics are not reduced over CP), or with
            attention dropout (the ring's blocks draw no dropout mask), or with the dense document mask
            (data.reset_attention_mask and data.create_attention_mask_in_dataloader) under p2p / a2a (they take the
            document offsets; all_gather takes either); a2a with heads (query or K/V, per TP rank) that cp does not
            divide.
    """
    cp = parallel.context_parallel_size
    if cp is None or cp < 1:
        raise ConfigError(f"parallel.context_parallel_size={cp} must be an integer >= 1 (1 = no context parallelism)")
    check_choice("parallel.cp_comm_type", parallel.cp_comm_type, CP_COMM_TYPES)
    if cp == 1:
        return
    s = model.seq_length
    if s % (2 * cp) != 0:
        lower = max(2 * cp, s // (2 * cp) * 2 * cp)
        raise ConfigError(
            f"model.seq_length={s} is not divisible by 2 × parallel.context_parallel_size = {2 * cp} (each CP rank "
            f"holds 2 of 2·cp equal chunks); set model.seq_length={lower} or {lower + 2 * cp}, or another cp")
    tp = parallel.tensor_model_parallel_size
    if parallel.sequence_parallel and tp > 1 and (s // cp) % tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits each CP rank's model.seq_length / context_parallel_size = "
            f"{s} / {cp} = {s // cp} tokens over tensor_model_parallel_size={tp}, which does not divide them; "
            "change model.seq_length or set parallel.sequence_parallel=false")
    if getattr(model, "num_moe_experts", None):
        raise ConfigError(f"parallel.context_parallel_size={cp} is not supported with an MoE model "
                          f"(model.num_moe_experts={model.num_moe_experts}); set parallel.context_parallel_size=1")
    if model.attention_dropout:
        raise ConfigError(f"parallel.context_parallel_size={cp} needs model.attention_dropout=0 (got "
                          f"{model.attention_dropout}): the CP attention draws no dropout mask")
    dense = data is not None and data.reset_attention_mask and data.create_attention_mask_in_dataloader
    if dense and parallel.cp_comm_type != "all_gather":
        # the ring and a2a compute the documents from the offsets; the dense mask's rows are all_gather's only
        raise ConfigError(f"data.create_attention_mask_in_dataloader=true with parallel.context_parallel_size={cp} "
                          f"needs parallel.cp_comm_type=all_gather (cp_comm_type={parallel.cp_comm_type} takes the "
                          "document offsets); set data.create_attention_mask_in_dataloader=false")
    if parallel.cp_comm_type == "a2a":
        heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
        if (heads // tp) % cp or (groups // tp) % cp:
            raise ConfigError(
                f"parallel.cp_comm_type=a2a splits each TP rank's heads over context_parallel_size={cp}: "
                f"model.num_attention_heads={heads} and num_query_groups={groups} over tp={tp} give "
                f"{heads // tp} and {groups // tp}, which {cp} must divide; use cp_comm_type=p2p or another cp")


def chunk_bounds(seq_length: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, end) token ranges of the full sequence that CP rank ``cp_rank`` holds, in order."""
    c = seq_length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return (first * c, (first + 1) * c), (second * c, (second + 1) * c)


def local_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """``[s/cp]`` int64: the global positions of this rank's tokens (chunk r, then chunk 2·cp − 1 − r).

    ``seq_length`` is the full sequence length s.
    """
    (a, b), (c, d) = chunk_bounds(seq_length, cp_size, cp_rank)
    return torch.cat([torch.arange(a, b, device=device), torch.arange(c, d, device=device)])


def slice_sequence(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This CP rank's two chunks of ``t`` along ``dim`` (full length s there), concatenated: length s/cp."""
    s = t.shape[dim]
    (a, b), (c, d) = chunk_bounds(s, cp_size, cp_rank)
    return torch.cat([t.narrow(dim, a, b - a), t.narrow(dim, c, d - c)], dim=dim)


def slice_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """A micro-batch's CP slice (Megatron ``get_batch_on_this_cp_rank``).

    Args:
        batch: {"tokens", "labels", "position_ids", "loss_mask": [b, s], "attention_mask": None or
            [b, 1, s, s] bool, optionally "cu_seqlens": None or [b, s + 1] int64}.
    Returns:
        the same keys: ``[b, s/cp]`` for the token tensors; the attention mask keeps its columns (the whole
        sequence's keys, in global order) and only this rank's query rows: ``[b, 1, s/cp, s]``; ``cu_seqlens``
        whole (the document boundaries of the whole sequence, in global positions).
    """
    if cp_size == 1:
        return batch
    whole = ("attention_mask", "cu_seqlens")
    out = {k: (slice_sequence(v, 1, cp_size, cp_rank) if v is not None else None)
           for k, v in batch.items() if k not in whole}
    if "cu_seqlens" in batch:
        out["cu_seqlens"] = batch["cu_seqlens"]
    mask: Optional[torch.Tensor] = batch.get("attention_mask")
    out["attention_mask"] = None if mask is None else slice_sequence(mask, 2, cp_size, cp_rank)
    return out
