"""Checkpoints in a single process, without torch.distributed: read full tensors, write an iteration-0
checkpoint tensor by tensor, and the consolidated safetensors form.

Readers: `mptrain.generate` (folder, meta.json, model config), ``python -m mptrain.export`` and the
Hugging Face conversion (`mptrain.hf`). DCP is read with ``no_dist=True``; each tensor comes back at
its full unpadded shape from whatever TP / PP / DP / ZeRO-1 layout wrote it, the fp32 master weight
(``main/<name>``) preferred when the run kept one.

Consolidated form (``--format safetensors``): ``model.safetensors`` ({tp1pp1 parameter name: full
unpadded tensor}) and ``config.json`` ({"format", "iteration", "vocab_size", "model": the saved model
config}); `load_consolidated` makes a tp1pp1 `GPTModel` of it in a plain process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Optional

import torch

from mptrain.checkpoint import atomic, dcp_io, integrity
from mptrain.checkpoint.reshard import Chunk
from mptrain.errors import ConfigError

CONSOLIDATED_FORMAT = "mptrain-consolidated-1"


def checkpoint_folder(checkpoint: str, iteration: Optional[int] = None) -> Path:
    """The ``iter_N`` folder to read: ``checkpoint`` itself when it is a complete one, else the one its
    ``latest`` (or ``iteration``) names; its files verified first against ``manifest.json``, as training's
    load does (`mptrain.checkpoint.integrity.verify_folder`; a folder saved before manifests passes).

    Raises:
        FileNotFoundError: no complete checkpoint there.
        ConfigError: a file is corrupt, truncated or missing (one line naming it and the fix).
    """
    folder = Path(checkpoint)
    if not atomic.is_complete(folder):
        folder, _ = atomic.resolve_load_dir(checkpoint, iteration)
        if folder is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint}; pass a checkpoint.save folder (with "
                                    "`latest`) or one iter_N folder")
    problem = integrity.verify_folder(folder, rank=0, world_size=1)
    if problem is not None:
        raise ConfigError(f"--checkpoint: {problem}; restore the file from an intact copy of the checkpoint, or "
                          "read another saved iteration (--iteration N)")
    return folder


def atomic_meta(folder: Path) -> dict:
    """meta.json of ``folder``, its saved tokenizer file found beside the checkpoint when moved
    (`mptrain.checkpoint.api.atomic_meta` with ``required=True``). Raises OSError / ValueError when unreadable."""
    from mptrain.checkpoint.api import atomic_meta as read_meta

    return read_meta(folder, required=True)


def model_config_from_dict(model: dict):
    """A `ModelConfig` from a saved model-config dict (unknown keys ignored)."""
    from mptrain.config.model import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in model.items() if k in names})


def single_rank_groups():
    """ParallelGroups of a world of one, made without torch.distributed (no group handles)."""
    from mptrain.groups import GROUP_KINDS, ParallelGroups

    return ParallelGroups(world_size=1, rank=0, tp_size=1, pp_size=1, dp_size=1, vpp_size=None, tp_rank=0, dp_rank=0,
                          pp_rank=0, ranks={k: [0] for k in GROUP_KINDS}, handles={k: None for k in GROUP_KINDS})


def _tp1_model(model: dict, *, vocab_size: int, **kwargs):
    from mptrain.config.parallel import ParallelConfig
    from mptrain.layers.gpt import build_model_chunks

    return build_model_chunks(model_config_from_dict(model), ParallelConfig(), single_rank_groups(),
                              vocab_size=int(vocab_size), **kwargs)[0]


def shard_specs(model: dict) -> dict:
    """{tp1pp1 name: `mptrain.layers.sharding.ShardSpec`} of every parameter of ``model`` (a model dict), from the
    trainer's own `build_model_chunks` on the meta device (no memory, no init cost): each global unpadded shape,
    TP-split dim and interleave (SwiGLU's fc1: 2), whatever the TP size."""
    from mptrain.layers.sharding import collect_shard_specs

    return collect_shard_specs(_tp1_model(model, vocab_size=model["vocab_size"], device=torch.device("meta")))


def expected_shapes(model: dict) -> dict:
    """{tp1pp1 name: global unpadded shape} of every parameter of ``model`` (a model dict): `shard_specs`' shapes."""
    return {name: tuple(spec.global_shape) for name, spec in shard_specs(model).items()}


def _load_quietly(folder: Path, chunks: list) -> None:
    with warnings.catch_warnings():  # DCP notes that it runs without torch.distributed: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_io.load_chunks(str(folder), chunks, [], no_dist=True)


def model_tensors(folder: Path, *, fp32_master: bool = True) -> dict:
    """{tp1pp1 parameter name: (checkpoint key to read, full shape, saved dtype)} of ``folder``."""
    metadata = dcp_io.read_metadata(str(folder))
    tkeys = dcp_io.tensor_keys(metadata)
    out = {}
    for key, (shape, _) in sorted(tkeys.items()):
        if key.startswith("model/"):
            name = key[len("model/"):]
            src = f"main/{name}" if fp32_master and f"main/{name}" in tkeys else key
            out[name] = (src, tuple(shape), dcp_io.tensor_dtype(metadata, src))
    return out


def load_tensor(folder: Path, entry: tuple) -> torch.Tensor:
    """One tensor of ``folder`` at its full shape and saved dtype; ``entry`` from `model_tensors`."""
    key, shape, dtype = entry
    full = torch.empty(shape, dtype=dtype)
    _load_quietly(folder, [Chunk(key, shape, (0,) * len(shape), full)])
    return full


def load_full_state(checkpoint: str, iteration: Optional[int] = None, *, fp32_master: bool = True) -> tuple[dict, dict]:
    """All model weights of a checkpoint ({tp1pp1 name: tensor}) and its meta.json, in a single process.

    Args:
        checkpoint: the ``checkpoint.save`` folder (with ``latest``) or one ``iter_N`` folder.
        iteration: which iteration (default: ``latest``).
        fp32_master: prefer the fp32 main params (``main/<name>``) over half-precision weights.
    Raises:
        FileNotFoundError, ConfigError: as `checkpoint_folder`.
    """
    folder = checkpoint_folder(checkpoint, iteration)
    entries = model_tensors(folder, fp32_master=fp32_master)
    out = {name: torch.empty(shape, dtype=dtype) for name, (_, shape, dtype) in entries.items()}
    _load_quietly(folder, [Chunk(key, shape, (0,) * len(shape), out[name]) for name, (key, shape, _) in entries.items()])
    return out, atomic_meta(folder)


def check_new_output(path: Path, what: str) -> None:
    """``path`` is a new or empty folder: exports and imports never mix their files with existing ones (a stale
    shard beside a new index, or an import taking over a run's ``latest``).

    Raises:
        ConfigError: ``path`` is a file or a folder that holds anything (one line).
    """
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise ConfigError(f"{what}: --output {path} already exists and is not an empty folder; pick a new folder "
                          "(nothing there is overwritten)")


def normal_modes(out: Path, names) -> None:
    """rw-r--r-- (less the umask) on the files written: safetensors writes through a 0600 temp file."""
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        os.chmod(out / name, 0o644 & ~umask)


def export_consolidated(checkpoint: str, output: str, iteration: Optional[int] = None) -> Path:
    """Write ``output/model.safetensors`` + ``output/config.json`` (the module docstring's consolidated form)."""
    from safetensors.torch import save_file

    state, meta = load_full_state(checkpoint, iteration)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": CONSOLIDATED_FORMAT})
    config = {"format": CONSOLIDATED_FORMAT, "iteration": meta["iteration"], "vocab_size": meta["vocab_size"],
              "model": meta["config"]["model"]}
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    normal_modes(out, ["model.safetensors", "config.json"])
    return out


def load_consolidated(path: str, *, dtype: torch.dtype = torch.float32):
    """A tp1pp1 `GPTModel` with the consolidated weights, in a plain process (no torch.distributed).

    Padded vocab rows (``make_vocab_size_divisible_by``) are zero, as in training. Side effect: seeds
    torch's global RNG (model construction sets up an RNG tracker).

    Raises:
        ValueError: the safetensors file lacks or has extra parameters, or a shape differs.
    """
    from safetensors.torch import load_file

    from mptrain.layers.sharding import collect_shard_specs, take_shard

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    model = _tp1_model(config["model"], vocab_size=config["vocab_size"], params_dtype=dtype)
    specs = collect_shard_specs(model)
    names = dict(model.named_parameters())
    if set(names) != set(state):
        raise ValueError(f"{path}: parameters differ: missing {sorted(set(names) - set(state))}, "
                         f"extra {sorted(set(state) - set(names))}")
    with torch.no_grad():
        for name, param in names.items():
            spec = specs[name]
            if tuple(state[name].shape) != tuple(spec.global_shape):
                raise ValueError(f"{path}: {name} has shape {tuple(state[name].shape)}, model {spec.global_shape}")
            d = spec.partition_dim
            param.copy_(take_shard(state[name], spec, None if d is None else param.shape[d]))
    return model


def save_streamed(root: Path, tensors: dict, *, config: dict, extra: dict) -> Path:
    """Write ``root/iter_0000000`` + ``latest``: iteration 0, no optimizer state, that ``checkpoint.load=root``
    starts from at any layout. Each tensor is produced when DCP writes it and dropped after (one file per
    tensor: DCP's writer keeps every tensor of a file alive until that file is written), so the model is
    never twice in memory. meta.json and manifest.json as a training save writes them.

    Args:
        root: a folder without checkpoints (the caller checks it: `check_new_output`).
        tensors: {tp1pp1 name: (full shape, dtype, loader() -> the tensor)}.
        config: the saved config (``model`` with its ``vocab_size``, optionally ``data`` and ``checkpoint``).
        extra: more meta.json / common-state keys (an import's source and ``hf`` record).
    Returns:
        the ``iter_0000000`` folder.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    from mptrain.checkpoint.api import FORMAT

    class StreamingPlanner(dcp_io.ChunkSavePlanner):
        def resolve_data(self, write_item):  # each tensor converted when DCP writes it, then dropped
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return tensors[write_item.index.fqn[len("model/"):]][2]().contiguous()

    dtypes = {dtype for _, dtype, _ in tensors.values()}
    param_dtype = next((n for n, d in (("bfloat16", torch.bfloat16), ("float16", torch.float16)) if dtypes == {d}),
                       "float32")  # mixed or another dtype: trained from float32 weights
    common = {"format": FORMAT, "iteration": 0, "consumed_samples": 0, "scaler": None,
              "lr_scheduler": {"num_steps": 0}, "counters": {}, "vocab_size": config["model"]["vocab_size"],
              "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "vpp": None}, "param_dtype": param_dtype,
              "config": config, "torch_version": torch.__version__, **extra}
    # zero-memory stand-ins: DCP's plan reads only shape and dtype; the data comes from the loaders
    chunks = [Chunk(f"model/{name}", shape, (0,) * len(shape), torch.empty((), dtype=dtype).expand(shape))
              for name, (shape, dtype, _) in tensors.items()]
    tmp = atomic.prepare_tmp(str(root), 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False, thread_count=1)
        dcp.save({"common": common}, storage_writer=writer, planner=StreamingPlanner(chunks), no_dist=True)
    atomic.write_json(tmp / atomic.META_FILE, {k: v for k, v in common.items() if k not in ("scaler", "lr_scheduler",
                                                                                          "counters")})
    integrity.write_manifest(tmp, [])  # as a training save: loading verifies the folder against it
    atomic.publish(str(root), 0, None)
    return root / atomic.iter_dir_name(0)
