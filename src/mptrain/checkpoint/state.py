"""What a checkpoint holds, as layout-independent keys (DESIGN.md §4).

Tensor keys (global unpadded shapes; see `mptrain.checkpoint.reshard`), ``<name>`` being the
parameter's global name in the GPT chunk (``decoder.layers.<global layer>.…``, so PP changes
reshard too):

    model/<name>          the model weights, in the run's param dtype (fp32 / fp16 / bf16), and the model's
                          persistent buffers (an MoE router's fp32 ``expert_bias``)
    main/<name>           fp32 main params; only when the params are fp16 / bf16 (for fp32 runs
                          the main params *are* ``model/<name>``)
    optim/<name>/<state>  per-element optimizer state (Adam ``exp_avg`` / ``exp_avg_sq``, SGD
                          ``momentum_buffer``), fp32

Object keys (pickled by DCP): ``optim/<name>/<state>`` for scalar state (Adam's ``step``),
``common`` (iteration, consumed samples, loss scaler, LR scheduler, skip counters, layout, the
resolved config) and ``rng/tp<t>_pp<p>_dp<d>`` (one per rank, see `mptrain.checkpoint.rng`).

Not saved: padded vocabulary rows; the last stage's copy of a tied embedding (``is_shared_copy``:
it loads from ``model/embedding.word_embeddings.weight``, as do its main param and moments,
which equal the embedding's because their grads are all-reduced over the embedding group).

`TrainState` is what the save reads these from and the load fills in place (the training side
builds it: `mptrain.training.checkpointing`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import torch

from mptrain.checkpoint.reshard import flat_piece_chunks, param_chunks, tensor_chunks
from mptrain.layers.random import RNGStatesTracker
from mptrain.layers.sharding import collect_shard_specs, replicated_spec
from mptrain.optim.lr_scheduler import LRScheduler
from mptrain.precision.module import unwrap
from mptrain.precision.optimizer import OptimizerWrapper

EMBEDDING_KEY = "embedding.word_embeddings.weight"


@dataclasses.dataclass
class TrainState:
    """This rank's training state: what `mptrain.checkpoint.api.save_checkpoint` saves and
    `mptrain.checkpoint.api.maybe_load_checkpoint` restores in place.

    Args:
        chunks: this rank's model chunks, one per virtual stage (DDP / Float16Module wrappers or bare
            GPT chunks: `unwrap` reaches the GPT chunk and its `ShardSpec`s).
        optimizer: the optimizer wrapper; its ``sharded_state_dict()`` lists the fp32 main params, the
            inner optimizer's state, the loss scaler and the skip counters (the scaler is saved from
            there: it is not a field of its own).
        lr_scheduler: ``state_dict()`` / ``load_state_dict()`` (`LRScheduler`).
        rng_tracker: the model-parallel RNG streams (`mptrain.checkpoint.rng`).
        iteration: completed iterations (saved as checkpoint N; a load sets it, 0 when nothing loads).
        consumed_samples: samples consumed by those iterations (saved; a load sets it).
    """

    chunks: list
    optimizer: OptimizerWrapper
    lr_scheduler: LRScheduler
    rng_tracker: RNGStatesTracker
    iteration: int = 0
    consumed_samples: int = 0


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """One model parameter of this rank: its chunk-local name, checkpoint name and spec."""

    name: str  # in unwrap(chunk).named_parameters()
    ckpt_name: str  # the global key it is saved / loaded under
    param: torch.nn.Parameter
    spec: object
    # ZeRO-2 / ZeRO-3 of a bf16 / fp16 run: the param is FSDP's fp32 shard (the master weight); ``model/`` is
    # written in this compute dtype and ``main/`` in fp32, as a DDP run of that precision writes them
    save_dtype: Optional[torch.dtype] = None

    @property
    def saved_here(self) -> bool:
        """The tied embedding's last-stage copy is loaded but never saved."""
        return not self.spec.is_shared_copy


def persistent_buffers(model: torch.nn.Module) -> list:
    """``[(name, buffer)]`` of ``model``'s persistent buffers (those its ``state_dict`` holds), e.g. an MoE
    router's fp32 ``expert_bias``: model state that is not a parameter, replicated over TP."""
    out = []
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out


def param_records(chunks: list) -> list:
    """Every parameter of this rank's model chunks (all virtual stages), in chunk order, then their
    persistent buffers (saved and loaded as ``model/<name>`` like a replicated parameter; no optimizer state)."""
    out = []
    for chunk in chunks:
        inner = unwrap(chunk)
        specs = collect_shard_specs(inner)
        compute = getattr(chunk, "compute_dtype", None)  # a FullyShardedDataParallel chunk's
        for name, param in inner.named_parameters():
            spec = specs[name]
            save_dtype = compute if compute is not None and compute != param.dtype else None
            out.append(ParamRecord(name, EMBEDDING_KEY if spec.is_shared_copy else name, param, spec, save_dtype))
    for chunk in chunks:
        for name, buf in persistent_buffers(unwrap(chunk)):
            out.append(ParamRecord(name, name, buf, replicated_spec(buf)))
    return out


def model_chunks(records: list, *, tensor_keys: set | None = None) -> list:
    """Chunks of the model params.

    Saving (``tensor_keys`` None): ``model/<name>``, the shared copy excluded. Loading: every
    param; an fp32 param (its own main param) reads ``main/<name>`` when the checkpoint has it
    (a half-precision run's fp32 master weights), else ``model/<name>``.
    """
    out = []
    for r in records:
        if tensor_keys is None:
            if r.saved_here:
                chunks = param_chunks(f"model/{r.ckpt_name}", r.spec, r.param.data)
                if r.save_dtype is not None:  # copies in the compute dtype (the save reads them; nothing loads them)
                    chunks = [dataclasses.replace(c, view=c.view.to(r.save_dtype)) for c in chunks]
                out += chunks
            continue
        key = f"model/{r.ckpt_name}"
        if r.param.dtype == torch.float32 and f"main/{r.ckpt_name}" in tensor_keys:
            key = f"main/{r.ckpt_name}"
        out += param_chunks(key, r.spec, r.param.data)
    return out


def _piece_chunks(key: str, record: ParamRecord, piece, tensor: torch.Tensor) -> list:
    """Chunks of a tensor shaped like the piece's main param (the whole param, or a ZeRO-1 flat range)."""
    if piece.flat_range is not None:
        lo, hi = piece.flat_range
        return flat_piece_chunks(key, record.spec, tuple(piece.param.shape), lo, hi, tensor)
    return tensor_chunks(key, record.spec, tensor)


def _stepped(piece) -> torch.Tensor:
    """The tensor the inner optimizer steps for ``piece``: its own main param, or the model param itself."""
    return piece.main if piece.main is not None else piece.param


def optimizer_pieces(state, records: list) -> Iterator[tuple]:
    """(ParamRecord, `ParamState`) for every piece of a wrapper's `sharded_state_dict` (any wrapper kind)."""
    by_param = {id(r.param): r for r in records}
    for piece in state.params:
        record = by_param.get(id(piece.param))
        if record is None:
            raise KeyError("optimizer state for a parameter that is not in the model chunks")
        yield record, piece


def optimizer_save_items(state, records: list) -> tuple[list, dict]:
    """(chunks, objects) of a wrapper's `sharded_state_dict` ``state``: main params (``main/``, only for
    half-precision params) and optimizer state (``optim/``); shared copies excluded."""
    chunks, objects = [], {}
    for record, piece in optimizer_pieces(state, records):
        if not record.saved_here:
            continue
        # an fp32 model param is its main param, unless it is FSDP's master shard of a half-precision run
        if piece.main is not None and (piece.param.dtype != torch.float32 or record.save_dtype is not None):
            chunks += _piece_chunks(f"main/{record.ckpt_name}", record, piece, piece.main.detach())
        stepped = _stepped(piece)
        for key, value in piece.state.items():
            full = f"optim/{record.ckpt_name}/{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == stepped.shape:
                chunks += _piece_chunks(full, record, piece, value.detach())
            else:
                # scalars (Adam's step) go to CPU: a fused/capturable optimizer keeps them on the device
                objects[full] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    return chunks, objects


def optimizer_load_items(state, records: list, tensor_keys: set, object_keys: set) -> tuple[list, list]:
    """What loading a wrapper's `sharded_state_dict` ``state`` needs.

    Args:
        tensor_keys / object_keys: the keys present in the checkpoint.
    Returns:
        (chunks to fill, object keys to read). Main params are filled in place (from ``main/`` or, for
        fp32 checkpoints, ``model/``); each piece's ``state`` is replaced by fresh zero tensors (filled by
        the chunks) and object keys, which `resolve_optimizer_state` turns into values once read.
    """
    chunks, objs = [], []
    for record, piece in optimizer_pieces(state, records):
        name = record.ckpt_name
        if piece.main is not None:  # (an fp32 param that is its own main is loaded by model_chunks)
            main_key = f"main/{name}" if f"main/{name}" in tensor_keys else f"model/{name}"
            chunks += _piece_chunks(main_key, record, piece, piece.main.data)
        loaded = {}
        prefix = f"optim/{name}/"
        for key in sorted(k for k in tensor_keys if k.startswith(prefix)):
            value = torch.zeros_like(_stepped(piece), dtype=torch.float32)
            chunks += _piece_chunks(key, record, piece, value)
            loaded[key[len(prefix):]] = value
        for key in sorted(k for k in object_keys if k.startswith(prefix)):
            objs.append(key)
            loaded[key[len(prefix):]] = key
        piece.state = loaded
    return chunks, objs


def resolve_optimizer_state(state, objects: dict) -> None:
    """Replace the object keys `optimizer_load_items` left in each piece's ``state`` by the values read."""
    for piece in state.params:
        piece.state = {k: (objects[v] if isinstance(v, str) else v) for k, v in piece.state.items()}
