"""Safetensors folders as transformers writes them, through the ``safetensors`` library: ``model.safetensors``, or
shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` ({"metadata": {"total_parameters",
"total_size" (bytes)}, "weight_map": {name: file}}, as ``save_pretrained``); one tensor or one shard in memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mptrain.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config.json's dtype names
INDEX = "model.safetensors.index.json"


def _safe_open(path: Path):
    """Raises ConfigError: ``path`` is missing, truncated or not safetensors."""
    if not path.is_file():
        raise ConfigError(f"import-hf: {path} is missing ({INDEX} lists it); copy the whole Hugging Face folder")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - safetensors' error type is public only in recent releases
        raise ConfigError(f"import-hf: {path} cannot be read as safetensors ({str(err).splitlines()[0]}); the file "
                          "is truncated or damaged: copy it again") from None


class HFTensors:
    """The tensors of a Hugging Face folder, read one at a time, by the names ``rename`` gives the stored ones;
    ConfigError: neither ``model.safetensors`` nor the index is there (and `_safe_open`'s)."""

    def __init__(self, folder: Path, rename: Callable[[str], str] = str) -> None:
        single, self._handles = folder / "model.safetensors", {}
        if (folder / INDEX).is_file():
            stored = {name: folder / f for name, f in json.loads((folder / INDEX).read_text())["weight_map"].items()}
        elif single.is_file():
            self._handles[single] = _safe_open(single)
            stored = dict.fromkeys(self._handles[single].keys(), single)
        else:
            raise ConfigError(f"import-hf: {folder} has no model.safetensors or {INDEX} (save the model with safetensors)")
        self.names, self._files = {rename(name): name for name in stored}, stored

    def _slice(self, name: str):
        path = self._files[self.names[name]]
        if path not in self._handles:
            self._handles[path] = _safe_open(path)
        return self._handles[path].get_slice(self.names[name])

    def meta(self, name: str) -> torch.Tensor:
        """A zero-memory stand-in of the tensor: its shape and dtype (an empty read: no table of safetensors' codes)."""
        found = self._slice(name)
        return torch.empty(found.get_shape(), dtype=found[:0].dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        return self._slice(name)[:]


def write_shards(out: Path, sizes: list, load: Callable[[str], dict], max_shard_size_mb: float) -> list:
    """Shards filled in order up to ``max_shard_size_mb`` MB, as transformers cuts them (``sizes``: [(key, bytes)], a key's
    tensors, ``load(key)``: {name: tensor}, in one shard), and the index; returns the files written."""
    shards, limit = [[]], max_shard_size_mb * 1_000_000
    for key, size in sizes:
        if shards[-1] and sum(s for _, s in shards[-1]) + size > limit:
            shards.append([])
        shards[-1].append((key, size))
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, params = {}, 0
    for file, shard in zip(files, shards):
        tensors = {name: t.contiguous() for key, _ in shard for name, t in load(key).items()}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        params += sum(t.numel() for t in tensors.values())
    if len(files) > 1:
        index = {"metadata": {"total_parameters": params, "total_size": sum(s for _, s in sizes)}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(INDEX)
    return files
