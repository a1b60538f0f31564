"""Samples → the micro-batch dict of docs/ARCHITECTURE.md "Batch".

Megatron's `get_ltor_masks_and_position_ids` (`megatron/core/datasets/gpt_dataset.py`):
- `loss_mask` is 1 where the label is a real token (0 on padding past an epoch's end); with
  `eod_mask_loss` also 0 where the *input* token is EOD (Megatron masks on the inputs: the
  first token of the next document is not predicted from the previous one).
- `reset_position_ids`: positions restart at 0 after each EOD in the inputs.
- `reset_attention_mask`: tokens after an EOD cannot attend to tokens at or before it. The boundaries
  are `cu_seqlens` [b, s + 1] int64: per sequence 0, the position after each EOD, then s repeated
  to the fixed width (`mptrain.layers.document_mask`, which attends with them without an s × s mask).
  With `create_attention_mask` (Megatron's GPTDatasetConfig field; the trainer's
  `data.create_attention_mask_in_dataloader`) also the dense mask: [b, 1, s, s] bool, True = masked
  (causal included). Otherwise both are None and the model applies its causal mask.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


def collate(
    samples: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    eod: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
) -> dict[str, Optional[torch.Tensor]]:
    """Stack samples of s + 1 tokens into a micro-batch.

    Args:
        samples: b pairs (tokens int64 [s + 1], valid bool [s + 1]).
        eod: the tokenizer's end-of-document id.
        create_attention_mask: with `reset_attention_mask`, also build the dense mask (module docstring).
    Returns:
        tokens [b, s] int64 (= sample[:-1]), labels [b, s] int64 (= sample[1:]), loss_mask [b, s]
        float32, position_ids [b, s] int64, cu_seqlens None or [b, s + 1] int64 (`reset_attention_mask`),
        attention_mask None or [b, 1, s, s] bool (True = masked; `reset_attention_mask` and
        `create_attention_mask`).
    """
    data = np.stack([t for t, _ in samples])  # [b, s+1]
    valid = np.stack([v for _, v in samples])  # [b, s+1]
    return collate_arrays(data, valid, eod=eod, reset_position_ids=reset_position_ids,
                          reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
                          create_attention_mask=create_attention_mask)


def read_samples(dataset, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Samples `indices` of `dataset`, stacked: tokens [b, s + 1] and valid bool [b, s + 1].

    A dataset with a ``sample_batch(indices)`` method (`MockDataset`, `GPTDataset`, `BlendedDataset`) reads
    them in a few vectorised numpy calls; any other is read sample by sample (``sample(i)``). Why: the
    prefetch thread holds the GIL while it runs Python per sample, and at b = 64 that delays the main
    thread's kernel launches of a small model (numpy's array loops release the GIL).
    """
    sample_batch = getattr(dataset, "sample_batch", None)
    if sample_batch is not None:
        return sample_batch(indices)
    samples = [dataset.sample(i) for i in indices]
    return np.stack([t for t, _ in samples]), np.stack([v for _, v in samples])


def collate_arrays(
    data: np.ndarray,
    valid: np.ndarray,
    *,
    eod: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
) -> dict[str, Optional[torch.Tensor]]:
    """`collate` of samples already stacked: data [b, s + 1] (any integer dtype), valid bool [b, s + 1]."""
    data = data.astype(np.int64, copy=False)
    tokens, labels = data[:, :-1], data[:, 1:]
    b, s = tokens.shape
    loss_mask = valid[:, 1:].astype(np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
    allowed = cu_seqlens = None
    if reset_attention_mask:
        cu_seqlens = document_offsets(tokens, eod)
    if reset_attention_mask and create_attention_mask:
        allowed = np.broadcast_to(np.tril(np.ones((s, s), dtype=bool)), (b, s, s)).copy()  # [b, s(query), s(key)]
    if reset_position_ids or allowed is not None:
        for row in range(b):
            prev = 0
            for i in np.flatnonzero(tokens[row] == eod):
                if allowed is not None:
                    allowed[row, i + 1 :, : i + 1] = False
                if reset_position_ids:
                    position_ids[row, i + 1 :] -= i + 1 - prev
                    prev = i + 1
    return {
        "tokens": torch.from_numpy(np.ascontiguousarray(tokens)),
        "labels": torch.from_numpy(np.ascontiguousarray(labels)),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
        "attention_mask": None if allowed is None else torch.from_numpy(~allowed[:, None]),
        "cu_seqlens": None if cu_seqlens is None else torch.from_numpy(cu_seqlens),
    }


def document_offsets(tokens: np.ndarray, eod: int) -> np.ndarray:
    """cu_seqlens [b, s + 1] int64 of input tokens [b, s]: per row 0, i + 1 for each EOD at i < s - 1, then s
    up to the fixed width (a document ends with its EOD; `mptrain.layers.document_mask`)."""
    b, s = tokens.shape
    cu = np.full((b, s + 1), s, dtype=np.int64)
    cu[:, 0] = 0
    for row in range(b):
        starts = np.flatnonzero(tokens[row, :-1] == eod) + 1  # an EOD in the last position starts nothing
        cu[row, 1:1 + len(starts)] = starts
    return cu
