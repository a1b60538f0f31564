"""Layout-independent addressing: local tensors → boxes of the full, unpadded global tensor.

A checkpoint never stores a rank's tensor as such. It stores *chunks*: axis-aligned boxes
``(offsets, sizes)`` of the full tensor of ``ShardSpec.global_shape`` (e.g. ``[V, h]`` for the word
embedding, unpadded), each with a view into the local storage that holds those elements. Saving
writes every rank's chunks; loading asks for the boxes the *new* layout holds and
`torch.distributed.checkpoint` (DCP) reads whatever saved chunks overlap them. That is resharding
across TP / PP / DP / ZeRO-1 (Megatron ``dist_checkpointing``: ShardedTensor(key, global_shape,
global_offset), megatron/core/dist_checkpointing/mapping.py).

Three local forms map onto boxes:

- a TP shard of a parameter (and its fp32 main param / Adam moments, same shape): the slices of
  `mptrain.layers.sharding.shard_slices` along ``partition_dim`` (padded vocab rows are not
  covered, so they are never saved; interleaved fused weights give one box per part);
- a replicated parameter: one box, the whole tensor (DCP keeps one copy of identical boxes);
- an expert-parallel rank's experts (``[E_local, ...]``): dim 0 shifted by ``ShardSpec.expert_offset`` onto the
  global expert axis ``[E, ...]``, then as above (Megatron's ``SequentialMLP.sharded_state_dict`` offsets);
- a ZeRO-1 piece: elements ``[lo, hi)`` of the flattened local shard (`DistributedOptimizer`'s
  ``ShardEntry``), split by `flat_range_boxes` into at most ``2·ndim - 1`` boxes that are each
  contiguous in the flat piece, then mapped like a TP shard;
- a ZeRO-2 / ZeRO-3 shard (an FSDP DTensor param, its main param and moments): rows of the TP-local tensor,
  i.e. one flat range of it, mapped as a ZeRO-1 piece (`param_chunks`).

Worked example: vocab 100, h 16, tp 2, make_vocab_size_divisible_by 64 → V_pad 128, rank 1 holds
padded rows [64, 128) of which 36 are real: its chunk is offsets (64, 0), sizes (36, 16). Loaded at
tp 1 (V_pad 128, one shard of 100 real rows) the box (0, 0) × (100, 16) overlaps the saved chunks
of ranks 0 and 1; DCP reads both.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from mptrain.layers.sharding import ShardSpec, shard_slices


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One box of a global tensor and the local view that holds it.

    Attributes:
        key: the checkpoint key (``model/<global param name>``, ``optim/<name>/exp_avg``, ...).
        global_shape: shape of the full unpadded tensor.
        offsets: start of the box in global coordinates (one per dim).
        view: the local elements, shape == the box sizes (a view: loading writes into it).
    """

    key: str
    global_shape: tuple
    offsets: tuple
    view: torch.Tensor

    @property
    def sizes(self) -> tuple:
        return tuple(self.view.shape)


def flat_range_boxes(shape: tuple, lo: int, hi: int) -> list:
    """Split the flat (row-major) element range ``[lo, hi)`` of a tensor of ``shape`` into boxes.

    Each box is contiguous in flat order, so it is ``flat[start:start + numel].view(sizes)``.

    Args:
        shape: the tensor's shape (any ndim; 0-d counts as one element).
        lo, hi: flat element range, ``0 <= lo <= hi <= numel``.
    Returns:
        [(flat_start, offsets, sizes)] covering the range in order, no empty boxes.
        Example: shape (3, 4), [2, 11) → (2, (0, 2), (1, 2)), (4, (1, 0), (1, 4)), (8, (2, 0), (1, 3)).
    Raises:
        ValueError: the range is outside the tensor.
    """
    numel = math.prod(shape)
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"flat range [{lo}, {hi}) outside a tensor of shape {tuple(shape)} ({numel} elements)")
    if lo == hi:
        return []
    if len(shape) <= 1:
        return [(lo, (lo,) if shape else (), (hi - lo,) if shape else ())]
    inner = math.prod(shape[1:])
    first_row, last_row = lo // inner, (hi - 1) // inner
    if first_row == last_row or (lo % inner == 0 and hi % inner == 0):
        if lo % inner == 0 and hi % inner == 0:  # whole rows: one box
            return [(lo, (first_row,) + (0,) * (len(shape) - 1), (last_row - first_row + 1,) + tuple(shape[1:]))]
        # inside one row: recurse into it
        return [(first_row * inner + s, (first_row,) + o, (1,) + z)
                for s, o, z in flat_range_boxes(tuple(shape[1:]), lo - first_row * inner, hi - first_row * inner)]
    boxes = []
    head_end = (first_row + 1) * inner if lo % inner else lo
    if lo % inner:
        boxes += flat_range_boxes(shape, lo, head_end)
    tail_start = last_row * inner if hi % inner else hi
    if tail_start > head_end:
        boxes += flat_range_boxes(shape, head_end, tail_start)
    if hi % inner:
        boxes += flat_range_boxes(shape, tail_start, hi)
    return boxes


def global_chunks(key: str, spec: ShardSpec, local_shape: tuple, local_offsets: tuple, view: torch.Tensor) -> list:
    """The global boxes of a local box (``view`` at ``local_offsets`` inside the local shard).

    Args:
        key: checkpoint key. spec: the parameter's `ShardSpec`.
        local_shape: shape of the whole local shard (padded size along the vocab dim).
        local_offsets: where ``view`` starts inside the local shard.
        view: the box's elements (shape = box sizes).
    Returns:
        [Chunk] (padded rows dropped; several chunks when the box crosses interleaved parts).
    """
    gshape = tuple(spec.global_shape)
    if spec.expert_offset:  # an expert-parallel rank's experts: local dim 0 starts there on the global expert axis
        local_offsets = (local_offsets[0] + spec.expert_offset,) + tuple(local_offsets[1:])
    if spec.partition_dim is None:
        return [Chunk(key, gshape, tuple(local_offsets), view)]
    d = spec.partition_dim
    start, size = local_offsets[d], view.shape[d]
    out = []
    for local_start, global_start, n in shard_slices(spec, local_shape[d]):
        a, b = max(start, local_start), min(start + size, local_start + n)
        if a >= b:
            continue
        offsets = list(local_offsets)
        offsets[d] = global_start + (a - local_start)
        out.append(Chunk(key, gshape, tuple(offsets), view.narrow(d, a - start, b - a)))
    return out


def tensor_chunks(key: str, spec: ShardSpec, tensor: torch.Tensor) -> list:
    """Chunks of a whole local shard (a model param, or a main param / moment of the same shape)."""
    return global_chunks(key, spec, tuple(tensor.shape), (0,) * tensor.dim(), tensor)


def flat_piece_chunks(key: str, spec: ShardSpec, local_shape: tuple, lo: int, hi: int, flat: torch.Tensor) -> list:
    """Chunks of a ZeRO-1 piece: ``flat`` [hi - lo] holds elements [lo, hi) of the flattened local shard."""
    out = []
    for flat_start, offsets, sizes in flat_range_boxes(tuple(local_shape), lo, hi):
        n = math.prod(sizes)
        view = flat[flat_start - lo: flat_start - lo + n].view(sizes)
        out += global_chunks(key, spec, tuple(local_shape), offsets, view)
    return out


def param_chunks(key: str, spec: ShardSpec, param: torch.Tensor) -> list:
    """Chunks of a model param as this rank holds it: a plain tensor (`tensor_chunks`), or a DTensor sharded on
    dim 0 over DP by FSDP (ZeRO-2 / ZeRO-3), whose local rows are a flat range of the TP-local tensor (the
    DTensor's global shape), mapped like a ZeRO-1 piece (`flat_piece_chunks`). The views alias the local shard."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return tensor_chunks(key, spec, param)
    with torch.no_grad():
        local = param.to_local()
    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    lo = offsets[0] * math.prod(param.shape[1:]) if param.dim() > 0 else 0
    return flat_piece_chunks(key, spec, tuple(param.shape), lo, lo + local.numel(), local.reshape(-1))


def covered_elements(chunks: list) -> int:
    """Elements covered by non-overlapping boxes (``[(offsets, sizes)]``)."""
    return sum(math.prod(sizes) for _, sizes in chunks)


def check_coverage(key: str, global_shape: tuple, boxes: list) -> Optional[str]:
    """None when ``boxes`` (non-overlapping, as DCP validates at save) tile ``global_shape``; else why not."""
    need, have = math.prod(global_shape), covered_elements(boxes)
    if need != have:
        return f"{key}: the checkpoint holds {have} of its {need} elements"
    return None
