"""Global gradient-norm clipping and zero counting over model-parallel ranks.

The global L2 norm over the whole (layout-independent) model is

    ||g|| = sqrt( sum over ranks r of the grad-stats group  sum over grads g counted on r  sum g_i^2 )

where "counted on r" is decided by the caller (`ShardSpec.counts_on(tp_rank)`: TP-sharded weights
on every TP rank, TP-replicated params such as LayerNorm and row-parallel biases on TP rank 0
only, the last stage's copy of a tied embedding never). The grad-stats group is the model-parallel
group (TP × PP) for the plain optimizer; the distributed optimizer also reduces over DP, because
each DP rank holds a different shard (Megatron-LM megatron/core/optimizer/optimizer.py
`_filter_grads_for_norm`; `get_grad_norm_fp32`,
`clip_grad_by_total_norm_fp32`, `count_zeros_fp32` in megatron/core/optimizer/clip_grads.py).

``group`` arguments accept one ProcessGroup, None (no reduction) or a sequence of groups reduced
one after another (SUM over MP then over DP equals SUM over MP × DP, since the groups tile the grid).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

Groups = Union[None, "dist.ProcessGroup", Sequence["dist.ProcessGroup"]]


def all_reduce_over(tensor: torch.Tensor, group: Groups, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (one group, None, or several in turn); returns it.

    A host tensor over an NCCL group (the statistics of grads held in host memory, ``optim.optimizer_cpu_offload``)
    travels through a device copy: NCCL reduces device memory only."""
    if group is None or not dist.is_initialized():
        return tensor
    for g in group if isinstance(group, (list, tuple)) else (group,):
        if g is not None and dist.get_world_size(g) > 1:
            if tensor.device.type == "cpu" and dist.get_backend(g) == "nccl":
                staged = tensor.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(staged, op=op, group=g)
                tensor.copy_(staged)
            else:
                dist.all_reduce(tensor, op=op, group=g)
    return tensor


def _device_of(grads: list, device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    return grads[0].device if grads else torch.device("cpu")


def get_grad_norm_fp32(grads: list, group: Groups, *, device: Optional[torch.device] = None) -> torch.Tensor:
    """Global L2 norm of the given local grads: local sum of squares, all-reduced SUM over ``group``, sqrt.

    Args:
        grads: the local grads that count (any shapes; converted to fp32 for the sum). The caller
            filters them (`ShardSpec.counts_on`); every element passed is counted once per rank.
        group: the grad-stats group(s) (model-parallel group for the plain optimizer).
        device: where the result lives when ``grads`` is empty (must suit the backend: cuda for NCCL).
    Returns:
        0-dim float32 tensor on the grads' device: the global norm (no host sync).
    """
    dev = _device_of(grads, device)
    if grads:
        fp32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
        norms = torch._foreach_norm(fp32, 2)  # one multi-tensor pass: per-tensor L2 norms
        sum_sq = torch.stack(norms).pow(2).sum().to(dev)
    else:
        sum_sq = torch.zeros((), dtype=torch.float32, device=dev)
    sum_sq = sum_sq.reshape(1)
    all_reduce_over(sum_sq, group, dist.ReduceOp.SUM)
    return sum_sq.sqrt().reshape(())


def get_grad_norm_and_non_finite_count_fp32(grads: list, counted: torch.Tensor, group: Groups, *,
                                            device: Optional[torch.device] = None) -> tuple:
    """`get_grad_norm_fp32` over the grads with ``counted`` 1, and the number of *all* given grads
    holding an inf / nan (a replicated copy that does not count in the norm is still checked), in one
    multi-tensor pass and one 2-element SUM all-reduce over ``group``.

    Args:
        grads: fp32 grads. counted: float ``[len(grads)]`` mask on the grads' device, 1 = counts.
    Returns:
        (norm, non-finite count): 0-dim float32 tensors (no host sync).
    """
    dev = _device_of(grads, device)
    stats = torch.zeros(2, dtype=torch.float32, device=dev)  # [sum of squares, non-finite count]
    if grads:
        norms = torch.stack(torch._foreach_norm(grads, 2))
        stats = torch.stack([(norms.pow(2) * counted).sum(), (~torch.isfinite(norms)).sum().float()]).to(dev)
    all_reduce_over(stats, group, dist.ReduceOp.SUM)
    return stats[0].sqrt(), stats[1]


def clip_grads_by_total_norm(grads: list, max_norm: float, total_norm: Union[float, torch.Tensor]) -> None:
    """Scale ``grads`` in place by coef = max_norm / (total_norm + 1e-6) when coef < 1 (else leave them).

    Pass *all* grads that the optimizer steps (not only the counted ones): replicated copies must
    be scaled identically on every TP rank. With a tensor ``total_norm`` the coefficient is clamped
    to 1 and applied on device (no host sync; multiplying by exactly 1.0 changes nothing).
    """
    if not grads or max_norm <= 0:
        return
    if isinstance(total_norm, torch.Tensor):
        coef = (max_norm / (total_norm.float() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
        return
    coef = max_norm / (float(total_norm) + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)


def count_zeros_fp32(grads: list, group: Groups, *, device: Optional[torch.device] = None) -> torch.Tensor:
    """Number of exactly-zero elements in the given (counted) grads, summed over ``group``.

    Returns:
        0-dim float32 tensor (float so that counts above 2^31 survive every backend's all-reduce).
    """
    dev = _device_of(grads, device)
    total = torch.zeros(1, dtype=torch.float32, device=dev)
    for g in grads:
        total += (g == 0).sum().to(dev, torch.float32)
    all_reduce_over(total, group, dist.ReduceOp.SUM)
    return total.reshape(())
