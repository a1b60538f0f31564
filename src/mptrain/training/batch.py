"""Getting a micro-batch onto every rank of a stage that needs it (Megatron's get_batch + broadcast_data).

Only TP rank 0 of a stage that needs data reads from the data iterator; it broadcasts the tensors to
the other TP ranks of its group. Stages that need no data (middle pipeline stages, middle virtual
chunks) read nothing and receive nothing. Shapes are known from the config, so no shape exchange.

The reading rank checks each batch against the config before it is broadcast (`CheckedProvider`,
`check_batch`: shape [b, s], dtypes, ids < vocab), and the first tensor it broadcasts carries a
status word: tokens, labels and position_ids travel packed in one int64 buffer
``[status, tokens (b·s), labels (b·s), position_ids (b·s)]``, followed with document offsets
(``data.reset_attention_mask`` without the dense mask) by ``cu_seqlens (b·(s+1))``. When the read fails (a bad batch, or
the provider raising), the reader sends status 1 and then its error line; every TP rank raises the
same `BatchError`, so no rank is left in a broadcast of the wrong size (which gloo aborts on with
"Received data size doesn't match expected size", or NCCL hangs on). Packing makes that status
free: 2 broadcasts per micro-batch (int64 buffer, loss_mask) instead of the 4 of one per tensor.

The reading rank's batches come from `CheckedProvider`'s iterators as `PreparedBatch` objects: checked, packed
and copied to the device ahead of the step on CUDA (`mptrain.training.prefetch.BatchPrefetcher`), so the
``batch-generator`` time is what is left on the step's path: waiting for a batch that is not ready, the
TP broadcast. A plain iterator of host dicts works too (prepared when read).
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from mptrain.data.errors import DataError
from mptrain.groups import ParallelGroups
from mptrain.training.prefetch import BatchPrefetcher, PreparedBatch

_INT_KEYS = ("tokens", "labels", "position_ids")
PREFETCH_DEPTH = 2
"""Training micro-batches prepared ahead on CUDA: two, so that the next step's first micro-batch is ready
while this step's last one is still being read (`BatchPrefetcher`)."""


class BatchError(DataError):
    """A micro-batch that does not match the config (one line naming `data._target_` and the shapes)."""


def uses_document_offsets(cfg) -> bool:
    """Whether batches carry ``cu_seqlens`` (no ``[b, 1, s, s]`` mask): ``data.reset_attention_mask`` without
    ``data.create_attention_mask_in_dataloader`` (every CP rank gets them whole:
    `mptrain.layers.context_parallel.slice_batch`)."""
    return bool(cfg.data.reset_attention_mask) and not cfg.data.create_attention_mask_in_dataloader


def check_batch(batch: Any, *, micro_batch_size: int, seq_length: int, vocab_size: int, with_attention_mask: bool,
                source: str, document_offsets: bool = False) -> None:
    """The reading rank's check of one micro-batch against the config (`DatasetProvider` batches).

    Args:
        batch: what the provider yielded.
        micro_batch_size, seq_length: b and s: tokens / labels / position_ids / loss_mask must be [b, s].
        vocab_size: the model's (unpadded) vocabulary; ids of tokens and labels must be in [0, vocab_size).
        with_attention_mask: `data.reset_attention_mask`: the batch must carry a [b, 1, s, s] mask, or
            with `document_offsets` (`data.create_attention_mask_in_dataloader=false`) cu_seqlens [b, s + 1]
            int64, each row 0, non-decreasing, s last (`mptrain.layers.document_mask`).
        source: the provider's `data._target_`, for the message.
    Raises:
        BatchError: one line: the provider, the key, expected vs got.
    """
    where = f"data._target_={source} yielded a bad micro-batch"
    if not isinstance(batch, dict):
        raise BatchError(f"{where}: expected a dict with tokens, labels, loss_mask, position_ids, got {type(batch).__name__}")
    shape = (micro_batch_size, seq_length)
    expected = {"tokens": torch.int64, "labels": torch.int64, "position_ids": torch.int64, "loss_mask": None}
    for key, dtype in expected.items():
        t = batch.get(key)
        if not isinstance(t, torch.Tensor):
            raise BatchError(f"{where}: {key} is {type(t).__name__}, expected a tensor of shape {list(shape)} "
                             "(micro_batch_size × seq_length)")
        if tuple(t.shape) != shape:
            raise BatchError(f"{where}: {key} has shape {list(t.shape)}, expected {list(shape)} (train.micro_batch_size "
                             f"× model.seq_length = {micro_batch_size} × {seq_length})")
        if dtype is not None and t.dtype != dtype:
            raise BatchError(f"{where}: {key} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and not t.dtype.is_floating_point:
            raise BatchError(f"{where}: {key} has dtype {t.dtype}, expected a floating dtype (torch.float32)")
    for key in ("tokens", "labels"):
        t = batch[key]
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            raise BatchError(f"{where}: {key} holds ids in [{lo}, {hi}], expected ids in [0, {vocab_size}) "
                             "(the model's vocab_size); check data.tokenizer")
    if with_attention_mask and document_offsets:
        _check_cu_seqlens(batch.get("cu_seqlens"), micro_batch_size, seq_length, where)
    elif with_attention_mask:
        mask = batch.get("attention_mask")
        want = [micro_batch_size, 1, seq_length, seq_length]
        if not isinstance(mask, torch.Tensor) or list(mask.shape) != want:
            got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise BatchError(f"{where}: attention_mask is {got}, expected {want} bool (data.reset_attention_mask=true "
                             "and data.create_attention_mask_in_dataloader=true)")


def _check_cu_seqlens(cu: Any, micro_batch_size: int, seq_length: int, where: str) -> None:
    want = [micro_batch_size, seq_length + 1]
    fix = ("(data.reset_attention_mask=true: per sequence 0, its document starts, then s repeated; or set "
           "data.create_attention_mask_in_dataloader=true for a [b, 1, s, s] attention_mask)")
    if not isinstance(cu, torch.Tensor) or list(cu.shape) != want or cu.dtype != torch.int64:
        got = f"{list(cu.shape)} {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise BatchError(f"{where}: cu_seqlens is {got}, expected {want} torch.int64 {fix}")
    if bool((cu[:, 0] != 0).any() or (cu[:, -1] != seq_length).any() or (cu.diff(dim=1) < 0).any()):
        raise BatchError(f"{where}: cu_seqlens rows must start at 0, never decrease and end at s={seq_length} {fix}")


class CheckedProvider:
    """The trainer's view of a dataset provider: its iterators with every batch checked
    (`check_batch`) and the training samples read counted (`samples_read`, for layout.json).

    Args:
        provider: the built `DatasetProvider`.
        source: its `data._target_`.
        micro_batch_size, seq_length, vocab_size, with_attention_mask, document_offsets: see `check_batch`.
    """

    def __init__(self, provider: Any, *, source: str, micro_batch_size: int, seq_length: int, vocab_size: int,
                 with_attention_mask: bool, device: Optional[torch.device] = None, document_offsets: bool = False) -> None:
        self.provider, self.source = provider, source
        self.expect = dict(micro_batch_size=micro_batch_size, seq_length=seq_length, vocab_size=vocab_size,
                           with_attention_mask=with_attention_mask, source=source, document_offsets=document_offsets)
        self.device = torch.device(device if device is not None else "cpu")
        self.samples_read = 0
        """Training samples this rank has read (batches checked and handed to the model)."""

    def _checked(self, batches: Iterator) -> Iterator[dict]:
        for batch in batches:
            check_batch(batch, **self.expect)
            yield batch

    def _count(self, samples: int) -> None:
        self.samples_read += samples

    def _prepared(self, batches: Iterator, *, depth: int, on_take=None) -> BatchPrefetcher:
        prepare = functools.partial(prepare_batch, device=self.device,
                                    with_attention_mask=self.expect["with_attention_mask"],
                                    document_offsets=self.expect["document_offsets"])
        return BatchPrefetcher(self._checked(batches), prepare, device=self.device, depth=depth, on_take=on_take)

    def train_iterator(self, consumed_samples: int) -> BatchPrefetcher:
        """Micro-batches (`PreparedBatch`) from `consumed_samples` on, prepared ahead on CUDA (`BatchPrefetcher`); a batch
        counts in `samples_read` when the step takes it."""
        return self._prepared(iter(self.provider.train_iterator(consumed_samples)), depth=PREFETCH_DEPTH,
                              on_take=self._count)

    def eval_iterator(self, split: str) -> BatchPrefetcher:
        """Micro-batches (`PreparedBatch`) of `split`, prepared when asked for (an evaluation's iterator lives for one pass)."""
        return self._prepared(iter(self.provider.eval_iterator(split)), depth=0)

    def has_split(self, split: str) -> bool:
        return bool(self.provider.has_split(split))

    def state_dict(self) -> dict:
        return self.provider.state_dict()


def _read(data_iterator: Iterator) -> tuple[Optional[dict], Optional[BaseException]]:
    try:
        return next(data_iterator), None
    except Exception as exc:  # noqa: BLE001 - the other TP ranks must learn of it, whatever it is
        return None, exc


def get_batch(
    data_iterator: Optional[Iterator],
    groups: ParallelGroups,
    *,
    micro_batch_size: int,
    seq_length: int,
    with_attention_mask: bool,
    device: torch.device,
    document_offsets: bool = False,
) -> dict:
    """Next micro-batch on this rank, broadcast within the TP group (module docstring: the packing).

    Returns:
        {"tokens", "labels", "position_ids": [b, s] int64, "loss_mask": [b, s] float32,
         "attention_mask": None or [b, 1, s, s] bool (True = masked),
         "cu_seqlens": None or [b, s + 1] int64 (with_attention_mask and document_offsets; then no attention_mask)}.
    Raises:
        BatchError (every TP rank alike): the reader's batch failed `check_batch`; the reader's
            iterator raised: the reader re-raises that exception, the other TP ranks a `BatchError`
            carrying its message.
    """
    shape = (micro_batch_size, seq_length)
    n = micro_batch_size * seq_length
    offsets = with_attention_mask and document_offsets
    size = 1 + 3 * n + (micro_batch_size * (seq_length + 1) if offsets else 0)
    reader = groups.tp_rank == 0
    distributed = groups.tp_size > 1
    if not reader:
        packed = torch.empty(size, dtype=torch.int64, device=device)
    else:
        batch, error = _read(data_iterator)
        if error is not None and not distributed:
            raise error
        if error is None:
            # a BatchPrefetcher's batch is on the device already (the copy overlapped the previous step)
            prepared = batch if isinstance(batch, PreparedBatch) else prepare_batch(
                batch, device=device, with_attention_mask=with_attention_mask, document_offsets=document_offsets)
            packed = prepared.tensors["packed"]
        else:
            packed = torch.zeros(size, dtype=torch.int64, device=device)
            packed[0] = 1
    if distributed:
        dist.broadcast(packed, src=groups.tp_src_rank, group=groups.tp_group)
        # one host sync per micro-batch on the status word (Megatron's broadcast_data syncs on its size exchange too)
        if int(packed[0].item()):
            _fail(groups, reader, error if reader else None)
    tensors: dict[str, Any] = {k: packed[1 + i * n: 1 + (i + 1) * n].view(shape) for i, k in enumerate(_INT_KEYS)}
    tensors["cu_seqlens"] = packed[1 + 3 * n:].view(micro_batch_size, seq_length + 1) if offsets else None
    if reader:
        tensors["loss_mask"] = prepared.tensors["loss_mask"]
        tensors["attention_mask"] = prepared.tensors["attention_mask"]
    else:
        tensors["loss_mask"] = torch.empty(shape, dtype=torch.float32, device=device)
        tensors["attention_mask"] = (
            torch.empty((micro_batch_size, 1, seq_length, seq_length), dtype=torch.uint8, device=device)
            if with_attention_mask and not offsets
            else None
        )
    if distributed:
        for key in ("loss_mask", "attention_mask"):
            if tensors[key] is not None:
                dist.broadcast(tensors[key], src=groups.tp_src_rank, group=groups.tp_group)
    if tensors["attention_mask"] is not None:
        tensors["attention_mask"] = tensors["attention_mask"].bool()
    return tensors


def _on(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """``host`` on ``device``; to CUDA through pinned memory, so that the copy is asynchronous (a
    pageable host-to-device copy is staged by the driver and can wait for the work already enqueued
    on the stream, i.e. for the previous step, before the host may go on)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def prepare_batch(batch: dict, *, device: torch.device, with_attention_mask: bool,
                  document_offsets: bool = False) -> PreparedBatch:
    """The reading rank's device tensors of one checked micro-batch: ``packed`` (`_packed_on`; with
    ``with_attention_mask`` and ``document_offsets`` it ends with ``cu_seqlens``), ``loss_mask`` ``[b, s]``
    float32, ``attention_mask`` ``[b, 1, s, s]`` uint8 or None; on CUDA through pinned memory with
    non-blocking copies on the current stream (a `BatchPrefetcher`'s side stream when it prefetches)."""
    offsets = with_attention_mask and document_offsets
    mask = None if offsets else batch.get("attention_mask")
    return PreparedBatch({
        "packed": _packed_on(device, batch, _INT_KEYS + ("cu_seqlens",) if offsets else _INT_KEYS),
        "loss_mask": _on(device, batch["loss_mask"].to(torch.float32)),
        # bool is not a gloo dtype: the mask travels as uint8
        "attention_mask": _on(device, mask.to(torch.uint8)) if (with_attention_mask and mask is not None) else None,
    }, samples=int(batch["tokens"].shape[0]))


def _packed_on(device: torch.device, batch: dict, keys: tuple) -> torch.Tensor:
    """``[status 0, tokens, labels, position_ids(, cu_seqlens)]`` int64 on ``device`` (module docstring)."""
    ints = [batch[k].reshape(-1).to(torch.int64) for k in keys]
    return _on(device, torch.cat([torch.zeros(1, dtype=torch.int64), *ints]))  # packed on the host: one copy


def _fail(groups: ParallelGroups, reader: bool, error: Optional[BaseException]) -> None:
    """Status 1 was broadcast: the reader sends its error line, and every TP rank raises."""
    box = [f"{error}" if isinstance(error, DataError) else f"{type(error).__name__}: {error}"] if reader else [None]
    dist.broadcast_object_list(box, src=groups.tp_src_rank, group=groups.tp_group)
    if reader:
        raise error
    raise BatchError(f"{box[0]} (read by TP rank 0, global rank {groups.tp_src_rank}, of this TP group)")
