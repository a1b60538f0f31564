"""What one rank holds for its model states under its data-parallel strategy: the start-up log's line.

Counted from the objects built (each storage once):

- params: the model params' local storage (DDP: full TP/PP shards in the param dtype; ZeRO-2 / ZeRO-3: the local
  fp32 rows of FSDP's DTensors, which are also the master weights);
- grads: DDP's contiguous grad buffers (full size); ZeRO-2 / ZeRO-3: the reduced fp32 grad shards (1/dp);
- optimizer state: fp32 main params that are copies (mixed precision, ZeRO-1 pieces; none when the optimizer steps
  the params themselves, as fp32 DDP and FSDP's shards) plus the inner optimizer's per-element state, projected
  from the elements the wrapper steps (its state is created at the first step): Adam / AdamW 2 fp32 tensors, SGD
  1 with momentum, others as Adam.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mptrain.distributed.fsdp_optimizer import local_shard
from mptrain.distributed.strategy import FULLY_SHARDED, NO_SHARD, OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS

ZERO_STAGE = {NO_SHARD: "DDP", OPTIM: "ZeRO-1", OPTIM_GRADS: "ZeRO-2", OPTIM_GRADS_PARAMS: "ZeRO-3"}


@dataclasses.dataclass(frozen=True)
class HeldBytes:
    """Bytes this rank holds (module docstring)."""

    params: int
    grads: int
    optimizer_state: int


def _states_per_element(inner) -> int:
    if isinstance(inner, torch.optim.SGD):
        return 1 if inner.defaults.get("momentum", 0) else 0
    return 2  # Adam / AdamW (and, as the planner assumes, any other class)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


def aliases_param(main: torch.Tensor, param: torch.Tensor) -> bool:
    """``main`` (an optimizer entry's main param) is stored in ``param``'s local storage (no copy of its own)."""
    return main.numel() == 0 or _storage(main) == _storage(local_shard(param)[0])


def held_bytes(chunks: list, optimizer) -> HeldBytes:
    """`HeldBytes` of this rank's wrapped ``chunks`` and optimizer wrapper (start-up: before the first step)."""
    params = grads = 0
    for chunk in chunks:
        local = [local_shard(p)[0] for p in chunk.module.parameters()]
        params += sum(t.numel() * t.element_size() for t in local)
        if chunk.grad_buffers:
            grads += sum(b.data.numel() * b.data.element_size() for b in chunk.grad_buffers)
        else:  # FSDP: the reduced grad shards, in the fp32 reduce dtype
            grads += sum(t.numel() * 4 for t, p in zip(local, chunk.module.parameters()) if p.requires_grad)
    entries = getattr(optimizer, "entries", [])
    copies = sum(e.main.numel() * e.main.element_size() for e in entries if not aliases_param(e.main, e.model_param))
    owned = sum(e.main.numel() for e in entries)
    inner = getattr(optimizer, "optimizer", None)
    return HeldBytes(params=params, grads=grads,
                     optimizer_state=copies + owned * 4 * _states_per_element(inner))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def strategy_line(configured: str, strategy: str, dp_size: int, held: HeldBytes, *, cp_size: int = 1,
                  shard_size: Optional[int] = None, cpu_offload: bool = False) -> str:
    """``data-parallel: <strategy> (<ZeRO stage>, dp=N[, cp=C][, HSDP shard S x replicate R][, CPU offload]) | this
    rank holds params X, grads Y, optimizer state Z``; ``configured`` is the key's resolved value, ``strategy`` the
    one that runs (they differ at dp × cp = 1); ``cp_size``: the context-parallel ranks the data-parallel reduction
    (and the FSDP shards) also span; ``shard_size``: ``parallel.data_parallel_shard_size`` (null: all of dp × cp)."""
    parts = [ZERO_STAGE[strategy]] + (["FSDP2"] if strategy in FULLY_SHARDED else []) + [f"dp={dp_size}"]
    if cp_size > 1:
        parts.append(f"cp={cp_size}")
    dp_cp = dp_size * cp_size
    if shard_size is not None and shard_size != dp_cp:
        parts.append(f"HSDP shard {shard_size} x replicate {dp_cp // shard_size}")
    if strategy in FULLY_SHARDED and cpu_offload:
        parts.append("CPU offload")
    note = f" (parallel.data_parallel_sharding_strategy={configured}: nothing to shard at dp × cp = 1)" \
        if configured != strategy else ""
    return (f"data-parallel: {strategy} ({', '.join(parts)}){note} | this rank holds params "
            f"{_mib(held.params)}, grads {_mib(held.grads)}, optimizer state {_mib(held.optimizer_state)}")
