"""Megatron-LM checkpoint folders read without megatron-core: the tensors of the model, by name, and its ``args``.

A ``--save`` folder holds ``latest_checkpointed_iteration.txt`` (an iteration, or ``release``) and one folder per
saved iteration, ``iter_0000010/`` (or ``release/``), in one of two formats (Megatron-LM
``megatron/training/checkpointing.py``):

- ``torch_dist`` (``--ckpt-format torch_dist``, the default since core 0.8): megatron-core's
  ``dist_checkpointing`` on torch.distributed.checkpoint: ``.metadata``, ``__<rank>_<n>.distcp``, ``common.pt``
  (the dict's plain values: ``args``, ``iteration``, ``checkpoint_version``) and ``metadata.json`` (its backend).
  Each tensor is stored once at its global tp1 shape, under the key ``ShardedTensor.key``; the layers of a
  homogeneous block are one tensor with a leading layer dimension (``decoder.layers.self_attention.linear_qkv.weight``
  ``[L, (np + 2ng)·hn, h]``, ``transformer_block.py::sharded_state_dict``), else one per layer
  (``decoder.layers.3.…``); SwiGLU's ``linear_fc1`` is ``[gate; up]`` whatever the TP (``mlp.py::
  apply_swiglu_sharded_factory``; its ``singleton_local_shards`` form, two keys ``…weight_w`` / ``…weight_v``,
  is not read). A layer is read alone (a box of the stacked tensor), so the model is never whole in memory.
- ``torch`` (legacy): ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per TP rank TT and pipeline rank PPP, each
  ``{"model" (or "model0".. per virtual stage), "args", "checkpoint_version", "iteration", "optimizer",
  "rng_state", ...}``; ``model`` is that rank's ``state_dict`` with layer indices local to its chunk. Chunks
  hold consecutive layers in the order (virtual stage, pipeline rank) (``get_transformer_layer_offset``), so a
  chunk's first global layer is the count of layers of the chunks before it (uneven splits included). The TP
  shards of a tensor are kept apart here; `mptrain.megatron_ckpt.convert` joins them by mptrain's ShardSpec
  (Megatron's split: the same dims, SwiGLU's ``[gate_r; up_r]`` per rank).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp

from mptrain.checkpoint import dcp_io
from mptrain.checkpoint.atomic import MEGATRON_TRACKER as TRACKER
from mptrain.checkpoint.reshard import Chunk
from mptrain.errors import ConfigError
from mptrain.megatron_ckpt.pickles import load_pickle

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
"""The keys of GPTModel's tensors (the optimizer's are ``optimizer.…``, RNG and extra state are objects)."""
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class Source:
    """One tensor of the model as stored: its TP shards in TP-rank order (one for torch_dist: the whole tensor)."""

    shapes: tuple
    """The shape of each shard."""
    dtype: torch.dtype
    loaders: tuple
    """``loader() -> tensor`` per shard, read when called."""


@dataclasses.dataclass(frozen=True)
class MegatronCheckpoint:
    """What `read_checkpoint` found: the saved ``args`` and the model's tensors, not read yet."""

    folder: Path
    """The iteration's folder."""
    format: str
    """``torch_dist`` or ``torch`` (legacy)."""
    args: Any
    """The saved ``args`` Namespace."""
    iteration: Optional[int]
    checkpoint_version: Optional[float]
    layout: dict
    """{"tp", "pp", "vpp"} the checkpoint was written at (torch_dist: as its args say)."""
    tensors: dict
    """{name with the global layer index (Megatron's tp1 name): `Source`}."""

    @property
    def args_file(self) -> str:
        return str(self.folder / ("common.pt" if self.format == "torch_dist" else "mp_rank_00*/model_optim_rng.pt"))


def _is_iteration(folder: Path) -> bool:
    return (folder / "common.pt").is_file() or (folder / ".metadata").is_file() or any(
        _RANK_DIR.fullmatch(p.name) for p in folder.glob("mp_rank_*"))


def iteration_folder(path: str, iteration: Optional[int] = None) -> Path:
    """The iteration folder to read: ``path`` itself when it is one, else ``iter_<iteration>`` or the one
    ``latest_checkpointed_iteration.txt`` names. Raises ConfigError (one line) when there is none."""
    root = Path(path)
    if iteration is None and _is_iteration(root):
        return root
    tracker = root / TRACKER
    if iteration is None and not tracker.is_file():
        raise ConfigError(f"import-megatron: {root} holds no {TRACKER} and is not an iteration folder (iter_N with "
                          "common.pt or mp_rank_*); pass Megatron's --save folder or one iter_N folder")
    text = str(iteration) if iteration is not None else tracker.read_text().strip()
    if text != "release" and not text.isdigit():
        raise ConfigError(f"import-megatron: {tracker} holds {text[:40]!r}, not an iteration; pass --iteration N")
    folder = root / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not _is_iteration(folder):
        have = sorted(p.name for p in root.glob("iter_*")) + (["release"] if (root / "release").is_dir() else [])
        raise ConfigError(f"import-megatron: {folder} is not a checkpoint (iterations in {root}: {have or 'none'}); "
                          "pass --iteration N of one of them")
    return folder


def read_checkpoint(path: str, iteration: Optional[int] = None) -> MegatronCheckpoint:
    """The checkpoint at ``path`` (a ``--save`` folder or one iteration's folder), in either format.

    Raises:
        ConfigError: no checkpoint there, another format (``torch_dcp``, ``fsdp_dtensor``, zarr), missing ranks,
            a checkpoint_version before 3.0, expert-parallel files (one line each).
    """
    folder = iteration_folder(path, iteration)
    if (folder / "common.pt").is_file():
        return _torch_dist(folder)
    if any(_RANK_DIR.fullmatch(p.name) for p in folder.glob("mp_rank_*")):
        return _legacy(folder)
    raise ConfigError(f"import-megatron: {folder} has a .metadata but no common.pt: --ckpt-format torch_dcp or "
                      "fsdp_dtensor, which is not read; save it as torch_dist (Megatron-LM's --ckpt-convert-format)")


class _StorageReader(dcp.FileSystemReader):
    """DCP's file reader with the checkpoint's metadata read once: each layer is one `_read_box` (one ``dcp.load``),
    and a large run's ``.metadata`` (the optimizer's entries too) would otherwise be unpickled for every one."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self.metadata = super().read_metadata()

    def read_metadata(self, *args, **kwargs):
        return self.metadata


def _read_box(reader: _StorageReader, key: str, shape: tuple, dtype: torch.dtype, layer: Optional[int]) -> torch.Tensor:
    """Tensor ``key`` (full shape ``shape``), or its ``layer``-th slice along dim 0."""
    box = shape if layer is None else (1, *shape[1:])
    view = torch.empty(box, dtype=dtype)
    offsets = (0,) * len(shape) if layer is None else (layer, *(0,) * (len(shape) - 1))
    with warnings.catch_warnings():  # DCP notes that it runs without torch.distributed: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, storage_reader=reader, planner=dcp_io.ChunkLoadPlanner([Chunk(key, shape, offsets, view)], []),
                 no_dist=True)
    return view if layer is None else view[0]


def _torch_dist(folder: Path) -> MegatronCheckpoint:
    backend = json.loads((folder / "metadata.json").read_text()) if (folder / "metadata.json").is_file() else {}
    if backend.get("sharded_backend", "torch_dist") != "torch_dist":
        raise ConfigError(f"import-megatron: {folder} is a {backend['sharded_backend']} checkpoint; only torch_dist is "
                          "read (convert it with Megatron-LM's --ckpt-convert-format torch_dist)")
    common = load_pickle(folder / "common.pt")
    args = _args_of(common, folder / "common.pt")
    reader = _StorageReader(folder)
    metadata, layers = reader.metadata, int(args.num_layers)
    tensors: dict = {}
    for key, (shape, _) in sorted(dcp_io.tensor_keys(metadata).items()):
        if not key.startswith(MODEL_PREFIXES):
            continue
        dtype, stacked = dcp_io.tensor_dtype(metadata, key), re.fullmatch(r"decoder\.layers\.(\D.*)", key)
        if stacked and shape and shape[0] == layers:  # [L, ...]: one box per layer
            for i in range(layers):
                read = functools.partial(_read_box, reader, key, shape, dtype, i)
                tensors[f"decoder.layers.{i}.{stacked.group(1)}"] = Source((shape[1:],), dtype, (read,))
        else:
            tensors[key] = Source((shape,), dtype, (functools.partial(_read_box, reader, key, shape, dtype, None),))
    return MegatronCheckpoint(folder, "torch_dist", args, common.get("iteration"), common.get("checkpoint_version"),
                              _layout(args), tensors)


def _args_of(state: dict, where: Path) -> Any:
    args = state.get("args") if isinstance(state, dict) else None
    if args is None or not hasattr(args, "num_layers"):
        raise ConfigError(f"import-megatron: {where} holds no args Namespace; the model cannot be known (save the "
                          "checkpoint with Megatron-LM's pretrain_gpt.py)")
    return args


def _layout(args: Any) -> dict:
    return {"tp": getattr(args, "tensor_model_parallel_size", None), "pp": getattr(args, "pipeline_model_parallel_size", None),
            "vpp": getattr(args, "virtual_pipeline_model_parallel_size", None)}


def _legacy(folder: Path) -> MegatronCheckpoint:
    files = {}
    for sub in sorted(folder.glob("mp_rank_*")):
        m = _RANK_DIR.fullmatch(sub.name)
        if m is None:
            continue
        if m.group(3) is not None:
            raise ConfigError(f"import-megatron: {sub} is an expert-parallel rank: mptrain has no mixture of experts yet")
        files[(int(m.group(1)), int(m.group(2) or 0))] = sub / "model_optim_rng.pt"
    tp, pp = 1 + max(t for t, _ in files), 1 + max(p for _, p in files)
    absent = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + "/model_optim_rng.pt" for t in range(tp)
              for p in range(pp) if (t, p) not in files or not files[(t, p)].is_file()]
    if absent:
        raise ConfigError(f"import-megatron: {folder} lacks {absent[:3]} of its {tp} x {pp} (tp x pp) ranks; copy the "
                          "whole iteration folder")
    states = {rank: load_pickle(path) for rank, path in files.items()}  # mapped: tensors are read when used
    first = states[(0, 0)]
    args = _args_of(first, files[(0, 0)])
    version = first.get("checkpoint_version", 0)
    if version < 3.0:
        raise ConfigError(f"import-megatron: {files[(0, 0)]} has checkpoint_version {version}: its fused QKV predates "
                          "the per-query-group layout (3.0); load and save it once with a recent Megatron-LM")
    chunks = ["model"] if "model" in first else sorted((k for k in first if re.fullmatch(r"model\d+", k)),
                                                        key=lambda k: int(k[5:]))
    tensors: dict = {}
    offset = 0
    for chunk in chunks:  # virtual stage-major, then pipeline rank: the global layer order
        for p in range(pp):
            offset = _add_chunk(tensors, [states[(t, p)][chunk] for t in range(tp)], offset, f"{files[(0, p)]}[{chunk!r}]")
    layout = {"tp": tp, "pp": pp, "vpp": len(chunks) if len(chunks) > 1 else None}
    return MegatronCheckpoint(folder, "torch", args, first.get("iteration"), version, layout, tensors)


def _add_chunk(tensors: dict, shards: list, offset: int, where: str) -> int:
    """The tensors of one model chunk (its TP ranks' state dicts) into ``tensors``, its layers from global index
    ``offset``. Returns the next chunk's first layer."""
    local = sorted({int(m.group(1)) for m in map(_LAYER.fullmatch, shards[0]) if m})
    if local != list(range(len(local))):
        raise ConfigError(f"import-megatron: {where} holds layers {local}, not 0..n-1 of its chunk; not a GPTModel state")
    for name, value in shards[0].items():
        if not isinstance(value, torch.Tensor) or name.endswith("_extra_state"):
            continue  # Transformer Engine's extra state: FP8 scaling metadata, no weights
        m = _LAYER.fullmatch(name)
        name_global = f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}" if m else name
        parts = [sd[name] for sd in shards]
        loaders: tuple = tuple(functools.partial(_same, t) for t in parts)
        tensors.setdefault(name_global, Source(tuple(tuple(t.shape) for t in parts), value.dtype, loaders))
    return offset + len(local)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def vocab_rows(tensors: dict) -> int:
    """Rows of the saved word embedding (its TP shards together): Megatron's padded vocabulary."""
    src = tensors.get("embedding.word_embeddings.weight")
    if src is None:
        raise ConfigError("import-megatron: the checkpoint has no embedding.word_embeddings.weight; not a GPTModel")
    return sum(shape[0] for shape in src.shapes)

