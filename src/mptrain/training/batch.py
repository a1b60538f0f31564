"""Getting a micro-batch onto every rank of a stage that needs it (Megatron's get_batch + broadcast_data).

Only TP rank 0 of a stage that needs data reads from the data iterator; it broadcasts the tensors to
the other TP ranks of its group. Stages that need no data (middle pipeline stages, middle virtual
chunks) read nothing and receive nothing. Shapes are known from the config, so no shape exchange.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from mptrain.groups import ParallelGroups

_INT_KEYS = ("tokens", "labels", "position_ids")


def get_batch(
    data_iterator: Optional[Iterator],
    groups: ParallelGroups,
    *,
    micro_batch_size: int,
    seq_length: int,
    with_attention_mask: bool,
    device: torch.device,
) -> dict:
    """Next micro-batch on this rank, broadcast within the TP group.

    Returns:
        {"tokens", "labels", "position_ids": [b, s] int64, "loss_mask": [b, s] float32,
         "attention_mask": None or [b, 1, s, s] bool (True = masked)}.
    """
    shape = (micro_batch_size, seq_length)
    reader = groups.tp_rank == 0
    if reader:
        batch = next(data_iterator)
        tensors = {k: batch[k].to(device, non_blocking=True) for k in (*_INT_KEYS, "loss_mask")}
        mask = batch.get("attention_mask")
        # bool is not a gloo dtype: the mask travels as uint8
        tensors["attention_mask"] = mask.to(device, torch.uint8) if (with_attention_mask and mask is not None) else None
    else:
        tensors = {k: torch.empty(shape, dtype=torch.int64, device=device) for k in _INT_KEYS}
        tensors["loss_mask"] = torch.empty(shape, dtype=torch.float32, device=device)
        tensors["attention_mask"] = (
            torch.empty((micro_batch_size, 1, seq_length, seq_length), dtype=torch.uint8, device=device)
            if with_attention_mask
            else None
        )
    if groups.tp_size > 1:
        for key in (*_INT_KEYS, "loss_mask", "attention_mask"):
            if tensors[key] is not None:
                dist.broadcast(tensors[key], src=groups.tp_src_rank, group=groups.tp_group)
    if tensors["attention_mask"] is not None:
        tensors["attention_mask"] = tensors["attention_mask"].bool()
    return tensors
