"""What a checkpoint holds, as layout-independent keys (DESIGN.md §4).

Tensor keys (global unpadded shapes; see `mptrain.checkpoint.reshard`), ``<name>`` being the
parameter's global name in the GPT chunk (``decoder.layers.<global layer>.…``, so PP changes
reshard too):

    model/<name>          the model weights, in the run's param dtype (fp32 / fp16 / bf16)
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
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from mptrain.checkpoint.reshard import flat_piece_chunks, tensor_chunks
from mptrain.layers.sharding import collect_shard_specs
from mptrain.precision.module import unwrap

EMBEDDING_KEY = "embedding.word_embeddings.weight"


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """One model parameter of this rank: its chunk-local name, checkpoint name and spec."""

    name: str  # in unwrap(chunk).named_parameters()
    ckpt_name: str  # the global key it is saved / loaded under
    param: torch.nn.Parameter
    spec: object

    @property
    def saved_here(self) -> bool:
        """The tied embedding's last-stage copy is loaded but never saved."""
        return not self.spec.is_shared_copy


def param_records(chunks: list) -> list:
    """Every parameter of this rank's model chunks (all virtual stages), in chunk order."""
    out = []
    for chunk in chunks:
        inner = unwrap(chunk)
        specs = collect_shard_specs(inner)
        for name, param in inner.named_parameters():
            spec = specs[name]
            out.append(ParamRecord(name, EMBEDDING_KEY if spec.is_shared_copy else name, param, spec))
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
                out += tensor_chunks(f"model/{r.ckpt_name}", r.spec, r.param.data)
            continue
        key = f"model/{r.ckpt_name}"
        if r.param.dtype == torch.float32 and f"main/{r.ckpt_name}" in tensor_keys:
            key = f"main/{r.ckpt_name}"
        out += tensor_chunks(key, r.spec, r.param.data)
    return out


def _entry_chunks(key: str, record: ParamRecord, entry, tensor: torch.Tensor) -> list:
    """Chunks of a tensor shaped like ``entry.main`` (a whole-shard main param, or a ZeRO-1 flat piece)."""
    if hasattr(entry, "lo") and hasattr(entry, "hi") and tensor.dim() == 1 and tensor.numel() == entry.hi - entry.lo:
        return flat_piece_chunks(key, record.spec, tuple(entry.model_param.shape), entry.lo, entry.hi, tensor)
    return tensor_chunks(key, record.spec, tensor)


def optimizer_entries(optimizer, records: list) -> Iterator[tuple]:
    """(ParamRecord, entry) for every main-param entry of the optimizer wrapper (any wrapper kind)."""
    by_param = {id(r.param): r for r in records}
    for entry in optimizer.entries:
        record = by_param.get(id(entry.model_param))
        if record is None:
            raise KeyError("optimizer entry for a parameter that is not in the model chunks")
        yield record, entry


def needs_main_key(entry) -> bool:
    """fp32 main params are saved separately only when the model params are half precision."""
    return entry.model_param.dtype != torch.float32


def optimizer_save_items(optimizer, records: list) -> tuple[list, dict]:
    """(chunks, objects) of main params and optimizer state for saving (shared copies excluded)."""
    chunks, objects = [], {}
    for record, entry in optimizer_entries(optimizer, records):
        if not record.saved_here:
            continue
        if needs_main_key(entry):
            chunks += _entry_chunks(f"main/{record.ckpt_name}", record, entry, entry.main.detach())
        for key, value in optimizer.optimizer.state.get(entry.main, {}).items():
            full = f"optim/{record.ckpt_name}/{key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == entry.main.shape:
                chunks += _entry_chunks(full, record, entry, value.detach())
            else:
                # scalars (Adam's step) go to CPU: a fused/capturable optimizer keeps them on the device
                objects[full] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    return chunks, objects


def optimizer_load_items(optimizer, records: list, tensor_keys: set, object_keys: set) -> tuple[list, list, list]:
    """What loading the optimizer needs.

    Args:
        tensor_keys / object_keys: the keys present in the checkpoint.
    Returns:
        (chunks to fill, object keys to read, [(entry, {state key: tensor to fill | object key})]).
        Main params are filled in place (from ``main/`` or, for fp32 checkpoints, ``model/``);
        per-element state goes into fresh zero tensors installed by `install_optimizer_state`.
    """
    chunks, objs, pending = [], [], []
    for record, entry in optimizer_entries(optimizer, records):
        name = record.ckpt_name
        if entry.main is not entry.model_param:  # (an fp32 param that is its own main is loaded by model_chunks)
            main_key = f"main/{name}" if f"main/{name}" in tensor_keys else f"model/{name}"
            chunks += _entry_chunks(main_key, record, entry, entry.main.data)
        state = {}
        prefix = f"optim/{name}/"
        for key in sorted(k for k in tensor_keys if k.startswith(prefix)):
            value = torch.zeros_like(entry.main, dtype=torch.float32)
            chunks += _entry_chunks(key, record, entry, value)
            state[key[len(prefix):]] = value
        for key in sorted(k for k in object_keys if k.startswith(prefix)):
            objs.append(key)
            state[key[len(prefix):]] = key
        pending.append((entry, state))
    return chunks, objs, pending


def install_optimizer_state(optimizer, pending: list, objects: dict) -> None:
    """Put the loaded state into the inner torch optimizer (objects resolved by key).

    Goes through ``torch.optim.Optimizer.load_state_dict`` so that torch applies its own placement
    rules (``step`` on the param's device for fused / capturable Adam, moments cast to the param's
    dtype and device). Params are numbered as torch's ``state_dict()`` numbers them: in
    ``param_groups`` order.
    """
    inner = optimizer.optimizer
    index, n = {}, 0
    for group in inner.param_groups:
        for p in group["params"]:
            index[id(p)] = n
            n += 1
    state = {}
    for entry, saved in pending:
        resolved = {k: (objects[v] if isinstance(v, str) else v) for k, v in saved.items()}
        if resolved:
            state[index[id(entry.main)]] = resolved
    sd = inner.state_dict()
    sd["state"] = state
    inner.load_state_dict(sd)
