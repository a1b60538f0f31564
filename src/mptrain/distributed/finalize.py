"""`finalize_model_grads`: everything between the last backward and the optimizer step.

Order (Megatron-LM ``megatron/core/distributed/finalize_model_grads.py``):

1. finish the DP sync of every chunk (all-reduce SUM, or reduce-scatter under ZeRO-1);
2. all-reduce SUM over TP the grads of params replicated over TP whose inputs were
   sequence-sharded (``spec.sequence_parallel_grad``: norms and row-parallel biases under SP) —
   each TP rank saw only its 1/tp of the sequence;
3. all-reduce SUM over ``groups.embedding_group`` the tied word-embedding grad (first stage's
   chunk 0 and last stage's last chunk, only when pp > 1) so both copies take the same step;
   correct under ZeRO-1 only because the tied param sits alone in its bucket (grad_buffer.py);
4. MoE aux-loss-free balancing: the expert biases step on this iteration's routed-token counts, summed over
   TP (under SP) and DP (`mptrain.layers.moe.update_expert_bias`; Megatron's ``_update_router_expert_bias``);
5. loss normalisation (ARCHITECTURE.md "Loss normalisation", derived here once): the schedule
   backpropagated ``loss_sum / max_tokens`` per micro-batch, and DP reduced by SUM, so the grads
   are ``d(Σ_all-ranks loss_sum) / max_tokens``. The loss we want is the mean over all
   loss-masked tokens of the global batch, ``Σ loss_sum / N`` with ``N`` = global token count,
   hence the factor ``max_tokens / N``. ``N`` lives on the last pipeline stage (it counted the
   tokens): broadcast over PP, then SUM over DP. With ``scale_grads=False`` the caller applies the
   factor itself (`token_scale`): the trainer folds it into the optimizer's unscale pass, which
   multiplies every grad anyway, instead of one more pass over all grads here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mptrain.layers.moe import update_expert_bias
from mptrain.precision.clip_grads import all_reduce_over


def _allreduce_coalesced(tensors: list, group) -> None:
    """SUM-all-reduce a list of tensors with one collective (flatten, reduce, copy back)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce_over(flat, group)  # host grads (offloaded shards) go through a device copy under NCCL
    offset = 0
    for t in tensors:
        t.view(-1).copy_(flat[offset : offset + t.numel()])
        offset += t.numel()


def _tp_grads_of_sequence_parallel_params(model_chunks: list) -> dict:
    """{dtype: [main_grad]} of params whose spec asks for a TP all-reduce (one collective per dtype)."""
    by_dtype: dict = {}
    for chunk in model_chunks:
        for name, _, grad in chunk.named_main_grads():
            if chunk.specs[name].sequence_parallel_grad:
                by_dtype.setdefault(grad.dtype, []).append(grad)
    return by_dtype


def _tied_embedding_grads(model_chunks: list, groups) -> list:
    """Main grads of the tied embedding on chunk 0 of the first stage / the last chunk of the last stage."""
    out = []
    for i, chunk in enumerate(model_chunks):
        holds = (i == 0 and groups.is_pipeline_first_stage()) or (
            i == len(model_chunks) - 1 and groups.is_pipeline_last_stage()
        )
        if holds:
            out += [g for name, _, g in chunk.named_main_grads() if chunk.specs[name].tied_embedding]
    return out


def finalize_model_grads(
    model_chunks: list,
    groups,
    *,
    num_tokens: Optional[torch.Tensor] = None,
    max_tokens: Optional[int] = None,
    scale_grads: bool = True,
) -> Optional[torch.Tensor]:
    """Finish the gradient reductions of one iteration and normalise the grads (see module docstring).

    Args:
        model_chunks: this rank's `DistributedDataParallel` chunks, in virtual-stage order.
        groups: `ParallelGroups`.
        num_tokens: loss-masked tokens this rank's schedule counted (0-d tensor or int; only the last
            pipeline stage's value is used, other stages may pass None or anything).
        max_tokens: the factor the schedule divided the loss by (global_batch_size × seq_length);
            None = 1 (grads are then divided by the global token count alone).
        With both None no normalisation happens (the same choice must be made on every rank).
        scale_grads: multiply the grads by ``token_scale(total, max_tokens)`` here (False: the
            caller does, e.g. ``optimizer.step(grad_scale=...)``).
    Returns:
        the global token count (0-d float64 tensor, same on every rank), or None without normalisation.
    """
    for chunk in model_chunks:
        chunk.finish_grad_sync()

    if groups.tp_size > 1:
        for grads in _tp_grads_of_sequence_parallel_params(model_chunks).values():
            _allreduce_coalesced(grads, groups.tp_group)

    if groups.pp_size > 1 and groups.is_in_embedding_group:
        # Both members of the embedding group run this (pp > 1 => two distinct ranks).
        _allreduce_coalesced(_tied_embedding_grads(model_chunks, groups), groups.embedding_group)

    update_expert_bias(model_chunks, groups)  # nothing without MoE routers that hold an expert bias

    if num_tokens is None and max_tokens is None:
        return None
    if num_tokens is None:
        total = torch.zeros((), dtype=torch.float64, device=groups.device)  # overwritten by the broadcast
    else:
        # the schedules return an int 0 on non-last stages: accept any number or tensor
        total = torch.as_tensor(num_tokens).detach().to(dtype=torch.float64, device=groups.device).clone().reshape(())
    if groups.pp_size > 1:
        dist.broadcast(total, src=groups.last_pp_rank, group=groups.pp_group)
    if groups.dp_cp_size > 1:  # CP ranks count the loss tokens of their own slices
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=groups.dp_cp_group)
    if scale_grads:
        factor = token_scale(total, max_tokens)
        for chunk in model_chunks:
            chunk.scale_gradients(factor)
    return total


def token_scale(total: torch.Tensor, max_tokens: Optional[int]) -> torch.Tensor:
    """``max_tokens / max(total, 1)`` (0-d float64 tensor, no host sync): the factor that turns the
    schedule's ``d(Σ loss_sum)/max_tokens`` grads into the per-token mean's. Empty batches (no
    loss-masked token) leave the grads unscaled rather than dividing by zero."""
    return float(max_tokens or 1) / torch.clamp(total, min=1.0)
