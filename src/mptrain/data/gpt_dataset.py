"""GPTDataset: fixed-length samples over one split of an indexed dataset, epoch by epoch.

After Megatron's `megatron/core/datasets/gpt_dataset.py` (document / sample / shuffle indices)
with one change: the order is built **per epoch** from an RNG seeded by (data.seed, split,
epoch), so asking for more samples extends the same order and nothing depends on
`train.train_iters` (Megatron sizes its indices by the number of samples the run will take).

A document here is one sequence of the index (`mptrain.data.indexed`: Megatron's GPT unit; one per
document unless Megatron preprocessed with `--split-sentences`).

Epoch e of a split with documents D (a contiguous range, `split_document_ranges`) and T tokens:
- `doc_idx` [|D|]: the documents in stream order (a permutation of D for train; D in order for
  valid / test). Their tokens back to back form the epoch's stream of T tokens.
- `sample_idx` [n + 1, 2]: (position in doc_idx, offset in that document) of stream position
  j·s, for n = ceil((T - 1) / s) samples (s = seq_length).
- `shuffle_idx` [n]: the order in which the epoch's samples are served (a permutation for train).

Sample j of an epoch is the stream window [j·s, j·s + s + 1): its inputs (first s tokens) tile
the stream, so one epoch predicts every token of the split exactly once (each position p ≥ 1 is a
label once) and samples span documents. The window past the stream's end (the epoch's last
sample only) is padded with EOD and flagged invalid, so its loss mask is 0 there.
Global sample g is sample shuffle_idx_e[g mod n] of epoch e = g div n.

The indices of an epoch are cached as `.npy` files under `cache_dir/<hash of (dataset, split,
seq_length, seed)>/` (written to a temporary name and renamed, so concurrent writers of the same
deterministic content are harmless) and memory-mapped when read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from mptrain.data.errors import DataError
from mptrain.data.indexed import IndexedDataset
from mptrain.errors import ConfigError

SPLITS = ("train", "valid", "test")
_INDEX_VERSION = 2  # 2: doc_idx counts the index's sequences (Megatron's GPT unit; 1 grouped them by document)
_KEEP_EPOCHS = 2  # epochs kept in memory (the current one and its neighbour)


def parse_split(split: Any) -> list[float]:
    """`"969,30,1"` (or `"969/30/1"`), or a list `[969, 30, 1]` → normalised weights [train, valid, test].

    Raises:
        ConfigError: not 1-3 non-negative numbers with a positive sum (names `data.split`).
    """
    if isinstance(split, str):
        parts: list = [p for p in split.replace("/", ",").split(",") if p.strip()]
    elif isinstance(split, Sequence) or hasattr(split, "__iter__"):  # a list, or OmegaConf's ListConfig
        split = list(split)
        parts = split
    else:
        parts = [split]
    try:
        weights = [float(p) for p in parts if not isinstance(p, bool)]
    except (TypeError, ValueError):
        weights = []
    if len(weights) != len(parts) or not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"data.split={split!r}: give train,valid,test weights (non-negative, sum > 0) as a list, "
                          "data.split=[969,30,1], or a quoted string, 'data.split=\"969,30,1\"'")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(split: Any, num_documents: int) -> dict[str, tuple[int, int]]:
    """Document ranges [begin, end) per split (Megatron's `get_split_indices`: rounded cumulative
    sums, the rounding error taken off the later boundaries so the last one is num_documents).

    Example: "969,30,1" over 42 documents → train [0, 41), valid [41, 42), test [42, 42).
    """
    weights = parse_split(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return {name: (max(0, bounds[i]), max(0, bounds[i + 1])) for i, name in enumerate(SPLITS)}


def _rng(seed: int, split: str, epoch: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), SPLITS.index(split), int(epoch)])


def _atomic_save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


class GPTDataset:
    """Samples of `seq_length + 1` tokens from documents [doc_begin, doc_end) of an indexed dataset.

    Args:
        indexed: the tokens.
        doc_range: (begin, end) document ids of this split.
        seq_length: s; a sample holds s + 1 tokens (inputs [:-1], labels [1:]).
        seed: `data.seed`.
        split: "train" | "valid" | "test" (part of the RNG seed and the cache key).
        shuffle: permute documents and samples per epoch (train); False keeps file order.
        eod: pad id for the epoch's last sample.
        cache_dir: folder for the per-epoch index files; None keeps them in memory only.
    Raises:
        DataError: the split has fewer than 2 tokens.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        doc_range: tuple[int, int],
        seq_length: int,
        seed: int,
        split: str,
        shuffle: bool,
        eod: int,
        cache_dir: Optional[str | os.PathLike] = None,
    ) -> None:
        self.indexed = indexed
        self.doc_begin, self.doc_end = map(int, doc_range)
        self.seq_length, self.seed, self.split, self.shuffle, self.eod = int(seq_length), int(seed), split, shuffle, int(eod)
        self.num_tokens = int(indexed.doc_lengths[self.doc_begin : self.doc_end].sum())
        if self.num_tokens < 2:
            raise DataError(
                f"{indexed.prefix}: the {split} split (documents [{self.doc_begin}, {self.doc_end})) has "
                f"{self.num_tokens} tokens; fix data.split or add documents"
            )
        self.num_samples_per_epoch = -(-(self.num_tokens - 1) // self.seq_length)
        self.cache_path: Optional[Path] = None
        if cache_dir is not None:
            self.cache_path = Path(cache_dir) / self._description_hash()
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._streams: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _description_hash(self) -> str:
        idx_sha = hashlib.sha1(Path(self.indexed.idx_path).read_bytes()).hexdigest()
        desc = {
            "class": "GPTDataset",
            "version": _INDEX_VERSION,
            "prefix": Path(self.indexed.prefix).name,
            "idx_sha1": idx_sha,
            "doc_range": [self.doc_begin, self.doc_end],
            "seq_length": self.seq_length,
            "seed": self.seed,
            "split": self.split,
            "shuffle": self.shuffle,
        }
        self.description = desc
        text = json.dumps(desc, sort_keys=True)
        return f"{Path(self.indexed.prefix).name}-{self.split}-{hashlib.md5(text.encode()).hexdigest()[:16]}"

    # --- indices -----------------------------------------------------------------------------
    def _doc_cum(self, doc_idx: np.ndarray) -> np.ndarray:
        """int64 [D + 1]: the stream offset of each document of `doc_idx` (in that order), then the total."""
        doc_cum = np.zeros(len(doc_idx) + 1, dtype=np.int64)
        np.cumsum(self.indexed.doc_lengths[doc_idx], out=doc_cum[1:])
        return doc_cum

    def _build_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        docs = np.arange(self.doc_begin, self.doc_end, dtype=np.int64)
        rng = _rng(self.seed, self.split, epoch)
        doc_idx = rng.permutation(docs) if self.shuffle else docs
        doc_cum = self._doc_cum(doc_idx)
        n = self.num_samples_per_epoch
        starts = np.arange(n + 1, dtype=np.int64) * self.seq_length
        # The document holding stream position p: the last d with doc_cum[d] <= p (empty
        # documents are skipped by "right"); position T (one past the end) maps past the last.
        pos = np.searchsorted(doc_cum, np.minimum(starts, self.num_tokens - 1), side="right") - 1
        sample_idx = np.stack([pos, np.minimum(starts, self.num_tokens - 1) - doc_cum[pos]], axis=1)
        shuffle_idx = rng.permutation(n).astype(np.int64) if self.shuffle else np.arange(n, dtype=np.int64)
        return doc_idx, sample_idx, shuffle_idx

    def epoch_indices(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(doc_idx [D], sample_idx [n+1, 2], shuffle_idx [n]) of `epoch`, from the cache when present."""
        if epoch in self._epochs:
            return self._epochs[epoch]
        arrays = None
        names = ("doc_idx", "sample_idx", "shuffle_idx")
        if self.cache_path is not None:
            paths = [self.cache_path / f"epoch_{epoch:05d}_{name}.npy" for name in names]
            if all(p.is_file() for p in paths):
                arrays = tuple(np.load(p, mmap_mode="r") for p in paths)
            else:
                arrays = self._build_epoch(epoch)
                self.cache_path.mkdir(parents=True, exist_ok=True)
                desc = self.cache_path / "description.json"
                if not desc.is_file():
                    tmp = desc.with_name(f"description.json.tmp-{os.getpid()}")
                    tmp.write_text(json.dumps(self.description, indent=1, sort_keys=True))
                    os.replace(tmp, desc)
                for p, a in zip(paths, arrays):
                    _atomic_save(p, a)
        else:
            arrays = self._build_epoch(epoch)
        while len(self._epochs) >= _KEEP_EPOCHS:
            self._epochs.pop(next(iter(self._epochs)))
        self._epochs[epoch] = arrays
        return arrays

    # --- samples -----------------------------------------------------------------------------
    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Global sample `index` (any non-negative int: epochs repeat with a new order).

        Returns:
            tokens int64 [s + 1]; valid bool [s + 1] (False on EOD padding past the epoch's end).
        """
        epoch, j = divmod(int(index), self.num_samples_per_epoch)
        doc_idx, sample_idx, shuffle_idx = self.epoch_indices(epoch)
        j = int(shuffle_idx[j])
        want = self.seq_length + 1
        start = j * self.seq_length
        take = min(want, self.num_tokens - start)
        d, offset = int(sample_idx[j, 0]), int(sample_idx[j, 1])
        pieces, got = [], 0
        while got < take:
            doc = int(doc_idx[d])
            piece = self.indexed.get_document(doc, offset, min(take - got, int(self.indexed.doc_lengths[doc]) - offset))
            pieces.append(piece)
            got += len(piece)
            d, offset = d + 1, 0
        tokens = np.full(want, self.eod, dtype=np.int64)
        tokens[:take] = np.concatenate(pieces) if pieces else []
        valid = np.zeros(want, dtype=bool)
        valid[:take] = True
        return tokens, valid

    def _stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(doc_cum [D + 1], doc_start [D]) of `epoch`: each document's offset in the epoch's token stream
        and its token offset in the .bin, in the epoch's document order."""
        if epoch not in self._streams:
            doc_idx = np.asarray(self.epoch_indices(epoch)[0])
            doc_cum = self._doc_cum(doc_idx)
            while len(self._streams) >= _KEEP_EPOCHS:
                self._streams.pop(next(iter(self._streams)))
            self._streams[epoch] = (doc_cum, self.indexed.doc_starts[doc_idx])
        return self._streams[epoch]

    def sample_batch(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Global samples `indices` (b of them), equal to stacking `sample`, read with one gather per epoch.

        Returns:
            tokens int64 [b, s + 1]; valid bool [b, s + 1] (False on EOD padding past the epoch's end).
        """
        epochs, js = np.divmod(np.asarray(indices, dtype=np.int64), self.num_samples_per_epoch)
        want = self.seq_length + 1
        tokens = np.full((len(js), want), self.eod, dtype=np.int64)
        valid = np.zeros((len(js), want), dtype=bool)
        for epoch in np.unique(epochs).tolist():
            rows = np.flatnonzero(epochs == epoch)
            doc_cum, doc_start = self._stream(epoch)
            shuffle_idx = self.epoch_indices(epoch)[2]
            pos = shuffle_idx[js[rows]][:, None] * self.seq_length + np.arange(want)  # stream positions [r, s + 1]
            ok = pos < self.num_tokens
            pos = np.minimum(pos, self.num_tokens - 1)
            # the document holding each position: the last d with doc_cum[d] <= p ("right" skips empty ones);
            # searched for the first and last positions, and for all of a sample's only where they differ
            first = np.searchsorted(doc_cum, pos[:, 0], side="right") - 1
            last = np.searchsorted(doc_cum, pos[:, -1], side="right") - 1
            d = np.repeat(first[:, None], want, axis=1)
            crossing = np.flatnonzero(first != last)
            d[crossing] = np.searchsorted(doc_cum, pos[crossing], side="right") - 1
            tokens[rows] = np.where(ok, self.indexed.tokens_at(doc_start[d] + pos - doc_cum[d]), self.eod)
            valid[rows] = ok
        return tokens, valid

    def stream_positions(self, index: int) -> tuple[int, np.ndarray]:
        """(epoch, stream positions [s + 1] of global sample `index`, -1 where padded). For tests."""
        epoch, j = divmod(int(index), self.num_samples_per_epoch)
        j = int(self.epoch_indices(epoch)[2][j])
        pos = j * self.seq_length + np.arange(self.seq_length + 1)
        return epoch, np.where(pos < self.num_tokens, pos, -1)
