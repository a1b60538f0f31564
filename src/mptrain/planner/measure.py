"""What the trainer really allocates on one rank: bytes of the objects `build_model_and_optimizer` builds.

Used by `mptrain.check` (objects on the meta device: shapes and dtypes, no memory) and by the
planner's tests (real CPU objects after one optimizer step, so Adam's state exists).
Each storage is counted once (fp32 runs step the model params in place: no main-param bytes;
fp32 grads of the distributed optimizer alias the grad buffer).
`cuda_activation_peak_bytes`: what the meta build cannot show, the activations of one micro-batch, measured
with CUDA's allocator (`mptrain.check` on a GPU machine).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc

import torch

from torch.distributed.tensor import DTensor

from mptrain.distributed.fsdp_optimizer import local_shard


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measured_rank_bytes(chunks: list, optimizer) -> dict:
    """Bytes of weights (with the FP8 weight casts under precision=fp8), grad buffers, fp32 main params and inner
    optimizer state on this rank.

    Args:
        chunks: the `DistributedDataParallel` / `FullyShardedDataParallel` chunks (as `build_model_and_optimizer`
            returns them).
        optimizer: the optimizer wrapper (`FP32Optimizer`, `MixedPrecisionOptimizer`, `DistributedOptimizer`,
            `FullyShardedOptimizer`).
    Returns:
        {"weights", "grads", "main_params", "optimizer_state", "numel", "num_params"}: bytes, except
        ``numel`` (parameter elements allocated) and ``num_params`` (layout.json convention: padding
        rows and the tied copy excluded, from the ShardSpecs).
    """
    params = [p for c in chunks for p in c.module.parameters()]
    # ZeRO-2 / ZeRO-3: FSDP's DTensors hold their local fp32 rows (the master weights), the reduced grads the same
    # rows in fp32 (made by the first backward: counted from the shards), no grad buffers
    local = [local_shard(p)[0] for p in params]
    fsdp_grads = sum(4 * t.numel() for c in chunks if not c.grad_buffers for t, p in
                     zip((local_shard(q)[0] for q in c.module.parameters()), c.module.parameters()) if p.requires_grad)
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
    # FSDP's main params are views of its fp32 shards (`FullyShardedOptimizer`): counted as the weights
    mains = [p.main for p in pieces if p.main is not None and not isinstance(p.param, DTensor)]
    state = 0
    for piece in pieces:
        for v in piece.state.values():
            if isinstance(v, torch.Tensor):
                state += _bytes(v)
    # precision=fp8: the FP8 weight casts the trainer keeps (`mptrain.layers.fp8.Fp8WeightCast`), as the planner
    casts = [m.fp8_weight_cast for c in chunks for m in c.module.modules() if getattr(m, "fp8_weight_cast", None)]
    cast_bytes = sum(_bytes(t) for w in casts for t in (w.data, w.data_t) if t is not None)
    return {
        "weights": sum(_bytes(t) for t in local) + cast_bytes,
        "grads": sum(_bytes(b.data) for c in chunks for b in c.grad_buffers) + fsdp_grads,
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


def cuda_activation_peak_bytes(cfg, groups, *, vocab_size: int, num_layers: int) -> dict:
    """Bytes one micro-batch's forward + backward allocates on CUDA above the weights, for the model of ``cfg``
    cut to ``num_layers`` transformer layers on one GPU (tp = pp = 1).

    The model is built as the trainer builds it (`build_model_chunks` in fp32, `Float16Module` for bf16 / fp16 /
    fp8, `apply_fp8` under precision=fp8) and run on a ``[train.micro_batch_size, model.seq_length]`` batch of
    random tokens, once to warm up and once measured. Weight grads are freed as soon as they are made (a hook per parameter): they live in the grad
    buffers the check counts apart, not in the activations.

    Args:
        cfg: a `Config` whose parallel keys say one stage at tp 1 (`mptrain.check.one_gpu_config`).
        groups: the `ParallelGroups` of a world of one, with ``device`` a CUDA device.
        num_layers: transformer layers of the measured model (``model.num_layers`` is replaced).
    Returns:
        {"peak": max_memory_allocated during forward + backward, "saved": allocated after the forward (what it
        keeps for backward, the loss included)}, both in bytes above what the model and its batch hold before.
    """
    from mptrain.layers.fp8 import apply_fp8, fp8_recipe_from
    from mptrain.layers.gpt import build_model_chunks
    from mptrain.precision import params_dtype
    from mptrain.precision.module import Float16Module

    model_cfg, parallel_cfg = copy.deepcopy(cfg.model), copy.deepcopy(cfg.parallel)  # keys added with `+` kept
    model_cfg.num_layers = num_layers
    # the fused weight-grad path writes into DDP's main_grad buffers, which this bare model has not
    parallel_cfg.gradient_accumulation_fusion = parallel_cfg.tp_comm_overlap = False
    device = groups.device
    chunk = build_model_chunks(model_cfg, parallel_cfg, groups, vocab_size=vocab_size, seed=cfg.train.seed,
                               params_dtype=torch.float32, device=device)[0]
    dtype = params_dtype(cfg.precision.name)
    model = chunk if dtype == torch.float32 else Float16Module(chunk, dtype, is_first_stage=True, is_last_stage=True)
    fp8 = apply_fp8([chunk], fp8_recipe_from(cfg.precision), num_layers=num_layers)
    model.train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    b, s = cfg.train.micro_batch_size, model_cfg.seq_length
    tokens = torch.randint(0, vocab_size, (b, s), device=device, generator=torch.Generator(device).manual_seed(0))
    position_ids = torch.arange(s, device=device).expand(b, s)
    casts = fp8.weight_casts.cached() if fp8 is not None and fp8.weight_casts else contextlib.nullcontext()
    with casts:
        # warm-up: a compiled chunk compiles (and autotunes, allocating as it goes) at its first call; the
        # measured pass below sees the steady state
        model(tokens, position_ids, None, labels=tokens).mean().backward()
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = model(tokens, position_ids, None, labels=tokens).mean()  # [b, s] per-token losses -> a scalar
        saved = torch.cuda.memory_allocated(device) - base
        loss.backward()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    del loss, casts, model, chunk, fp8, tokens, position_ids
    gc.collect()
    torch.cuda.empty_cache()  # the next measurement starts from an empty cache
    return {"peak": peak, "saved": saved}


def meta_groups(groups):
    """The same `ParallelGroups` with ``device=meta`` (build the trainer's objects without memory)."""
    return dataclasses.replace(groups, device=torch.device("meta"))


__all__ = ["cuda_activation_peak_bytes", "layers_of", "measured_rank_bytes", "meta_groups"]
