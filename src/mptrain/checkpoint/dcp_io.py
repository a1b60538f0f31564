"""Writing and reading `Chunk`s and plain objects with `torch.distributed.checkpoint` (DCP).

Mechanism (why not DTensor / ShardedTensor): our shards are uneven (padded vocabulary rows are
dropped, so rank r of tp holds ``valid`` ≤ V_pad/tp rows), some local tensors are several
global boxes (interleaved fused weights), and ZeRO-1 pieces are flat ranges. DTensor cannot express
that and `torch.distributed._shard.ShardedTensor` is deprecated. So we use DCP's documented
extension point, the planners (`SavePlanner` / `LoadPlanner`, torch ≥ 2.0; docs "Distributed
Checkpoint - torch.distributed.checkpoint", "Extension points"): `ChunkSavePlanner` emits one
``WriteItem(type=SHARD)`` per `Chunk` with its global ``ChunkStorageMetadata(offsets, sizes)``;
`ChunkLoadPlanner` asks DCP's own resharding routine, ``create_read_items_for_chunk_list``, for
the reads that fill the boxes this rank holds now, and hands DCP the local views to copy into.
Boxes saved identically by several ranks (TP / DP replicas) are written once (DCP's global plan
deduplicates write items by (key, offsets)). Plain objects (dicts, ints) are BYTE_IO items.
On disk: ``.metadata`` + one ``__<rank>_0.distcp`` per rank (FileSystemWriter).

Only public classes of ``torch.distributed.checkpoint.{planner, metadata}`` and
``planner_helpers.create_read_items_for_chunk_list`` are used (all present in torch 2.4 - 2.13).
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class ChunkSavePlanner(DefaultSavePlanner):
    """Saves `Chunk`s (tensor boxes) plus the plain objects passed to `dcp.save` as the state dict."""

    def __init__(self, chunks: list) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, tuple(c.offsets)): c for c in chunks}

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self.state_dict
        ]
        for (key, offsets), c in self._chunks.items():
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(c.sizes)),
                        properties=TensorProperties.create_from_tensor(c.view),
                        size=torch.Size(c.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.state_dict[write_item.index.fqn], buf)
            return buf
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        return chunk.view.detach().contiguous()


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Fills `Chunk` views from whatever saved boxes overlap them; loads the named objects.

    After `dcp.load`, ``objects`` maps each requested object key to its value.
    """

    def __init__(self, chunks: list, object_keys: list) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = list(chunks)
        self._object_keys = list(object_keys)
        self.objects: dict = {}

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for key in self._object_keys:
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        # One call per chunk, and the destination index hint set to the chunk's position in our list:
        # two chunks may share (key, offsets) (a half param and its fp32 main param both read from
        # ``model/<name>`` of an fp32 checkpoint), so (key, offsets) alone cannot name the destination.
        for i, c in enumerate(self._chunks):
            box = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
            dest = MetadataIndex(c.key, torch.Size(c.offsets), i)
            items += [dataclasses.replace(r, dest_index=dest) for r in create_read_items_for_chunk_list(c.key, md[c.key], [box])]
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination view of ``read_item``: our chunk at position ``dest_index.index``.

        Raises:
            RuntimeError: the index hint does not name a chunk of this key and offsets (it is DCP's
                ``MetadataIndex.index``, excluded from equality and hashing, so a planner change that
                recreated read items could drop it: fail loudly instead of filling the wrong view).
        """
        index = read_item.dest_index
        chunk = self._chunks[index.index] if index.index is not None and 0 <= index.index < len(self._chunks) else None
        if chunk is None or chunk.key != index.fqn or tuple(chunk.offsets) != tuple(index.offset):
            raise RuntimeError(f"checkpoint load: read destination {index} does not name one of this rank's chunks")
        view = chunk.view
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: DCP copied straight into it


def save_chunks(path: str, chunks: list, objects: dict, *, no_dist: bool = False, process_group=None) -> None:
    """Write ``chunks`` and ``objects`` ({key: picklable}) to folder ``path`` (collective on ``process_group``,
    default: the default group).

    Every rank passes its own chunks and objects; a key may be given by several ranks (identical
    boxes / values: one copy is kept).
    """
    dcp.save(dict(objects), storage_writer=dcp.FileSystemWriter(path), planner=ChunkSavePlanner(chunks), no_dist=no_dist,
             process_group=process_group)


def load_chunks(path: str, chunks: list, object_keys: list, *, no_dist: bool = False) -> dict:
    """Fill ``chunks`` (their views are written in place) and return {key: object} for ``object_keys``.

    Collective on the default group unless ``no_dist``. Keys must exist (check with `read_metadata`).
    """
    planner = ChunkLoadPlanner(chunks, object_keys)
    dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=planner, no_dist=no_dist)
    return planner.objects


def read_metadata(path: str) -> Metadata:
    """The checkpoint's DCP metadata (no collective): {key: TensorStorageMetadata | BytesStorageMetadata}."""
    return dcp.FileSystemReader(path).read_metadata()


def tensor_keys(metadata: Metadata) -> dict:
    """{key: (global shape, [(offsets, sizes)])} of every tensor in the checkpoint."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out[key] = (tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
    return out


def object_keys(metadata: Metadata) -> list:
    return [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]


def tensor_dtype(metadata: Metadata, key: str) -> Any:
    return metadata.state_dict_metadata[key].properties.dtype
