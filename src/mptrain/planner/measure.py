"""What the trainer really allocates on one rank: bytes of the objects `build_model_and_optimizer` builds.

Used by `mptrain.check` (objects on the meta device: shapes and dtypes, no memory) and by the
planner's tests (real CPU objects after one optimizer step, so Adam's state exists).
Each storage is counted once (fp32 runs step the model params in place: no main-param bytes;
fp32 grads of the distributed optimizer alias the grad buffer).
"""

from __future__ import annotations

import dataclasses

import torch


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measured_rank_bytes(chunks: list, optimizer) -> dict:
    """Bytes of weights (with the FP8 weight casts under precision=fp8), grad buffers, fp32 main params and inner
    optimizer state on this rank.

    Args:
        chunks: the `DistributedDataParallel` chunks (as `build_model_and_optimizer` returns them).
        optimizer: the optimizer wrapper (`FP32Optimizer`, `MixedPrecisionOptimizer`, `DistributedOptimizer`).
    Returns:
        {"weights", "grads", "main_params", "optimizer_state", "numel", "num_params"}: bytes, except
        ``numel`` (parameter elements allocated) and ``num_params`` (layout.json convention: padding
        rows and the tied copy excluded, from the ShardSpecs).
    """
    params = [p for c in chunks for p in c.module.parameters()]
    num_params = 0
    for c in chunks:
        for name, p in c.module.named_parameters():
            spec = c.specs[name]
            if spec.is_shared_copy:
                continue
            if spec.valid is not None and spec.partition_dim is not None:
                num_params += p.numel() // p.shape[spec.partition_dim] * spec.valid
            else:
                num_params += p.numel()
    pieces = optimizer.sharded_state_dict().params
    mains = [p.main for p in pieces if p.main is not None]
    state = 0
    for piece in pieces:
        for v in piece.state.values():
            if isinstance(v, torch.Tensor):
                state += _bytes(v)
    # precision=fp8: the FP8 weight casts the trainer keeps (`mptrain.layers.fp8.Fp8WeightCast`), as the planner
    casts = [m.fp8_weight_cast for c in chunks for m in c.module.modules() if getattr(m, "fp8_weight_cast", None)]
    cast_bytes = sum(_bytes(t) for w in casts for t in (w.data, w.data_t) if t is not None)
    return {
        "weights": sum(_bytes(p) for p in params) + cast_bytes,
        "grads": sum(_bytes(b.data) for c in chunks for b in c.grad_buffers),
        "main_params": sum(_bytes(m) for m in mains),
        "optimizer_state": state,
        "numel": sum(p.numel() for p in params),
        "num_params": num_params,
    }


def layers_of(chunks: list) -> list:
    """Global layer indices this rank holds (all chunks)."""
    out = []
    for c in chunks:
        inner = c.module
        while not hasattr(inner, "layer_numbers"):
            inner = inner.module
        out.extend(inner.layer_numbers)
    return sorted(out)


def meta_groups(groups):
    """The same `ParallelGroups` with ``device=meta`` (build the trainer's objects without memory)."""
    return dataclasses.replace(groups, device=torch.device("meta"))


__all__ = ["layers_of", "measured_rank_bytes", "meta_groups"]
