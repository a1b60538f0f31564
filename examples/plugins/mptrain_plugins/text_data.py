"""A user's dataset provider that is not an indexed dataset: plain text files read on the fly
(docs/COMPONENTS.md "Dataset provider").

Each file is one document: its text tokenized with the configured tokenizer, then EOD. The
documents of `files` (in the order given; globs sorted) form one token stream, cut into windows
of seq_length + 1 tokens that overlap by one (window j = stream[j·s : j·s + s + 1], so the inputs
tile the stream; a tail shorter than a window is dropped). Epoch e serves the windows in a
permutation drawn from NumPy's RNG seeded by (data.seed, e) (`shuffle=false`: file order); global
sample g is window perm_e[g mod n] of epoch e = g div n. DP rank r of d reads, per micro-step k
after `consumed_samples` c, samples [c + k·b·d + r·b, c + k·b·d + (r+1)·b) (Megatron's sampler), so
the global batch of iteration i holds samples [i·G, (i+1)·G) whatever the layout, and a resume
continues the stream exactly.

    python train.py data=shakespeare data._target_=mptrain_plugins.text_data.TextFileProvider \\
        '+data.files=[corpus/*.txt]' '+data.valid_files=[heldout.txt]' \\
        data.tokenizer._target_=mptrain_plugins.tokenizers.CharTokenizer

Construction uses no collective: every rank checks the arguments alike (so an error is raised on
every rank), and only ranks with `needs_data` read the files.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch


def _expand(patterns: Sequence[str], key: str) -> list[Path]:
    paths: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(str(pattern))) if glob.has_magic(str(pattern)) else [str(pattern)]
        if not matched or not all(Path(m).is_file() for m in matched):
            raise ValueError(f"data.{key}: {pattern!r} names no file; fix the path or the glob")
        paths += [Path(m) for m in matched]
    return paths


class TextFileProvider:
    """Windows of seq_length + 1 tokens over text files (module docstring).

    Args:
        files: training text files (paths or globs), one document each.
        valid_files: validation text files (served in order, from the start at each evaluation); empty: no valid split.
        shuffle: permute the windows per epoch (seeded by `seed`, i.e. data.seed).
        seed: data.seed.
        tokenizer, seq_length, micro_batch_size, global_batch_size, dp_rank, dp_size, needs_data: the runtime's.
    Raises:
        ValueError: no files, a missing file, or fewer tokens than one window.
    """

    def __init__(self, *, files: Sequence[str], tokenizer: Any, seq_length: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int, needs_data: bool, seed: int = 1234,
                 valid_files: Sequence[str] = (), shuffle: bool = True) -> None:
        if not files:
            raise ValueError("data.files is empty; give +data.files=[PATH, ...]")
        self.train_paths, self.valid_paths = _expand(files, "files"), _expand(valid_files or [], "valid_files")
        self.tokenizer, self.seq_length, self.seed, self.shuffle = tokenizer, int(seq_length), int(seed), bool(shuffle)
        self.micro_batch_size, self.dp_rank, self.dp_size, self.needs_data = micro_batch_size, dp_rank, dp_size, needs_data
        self.consumed_samples = 0
        self._windows: dict[str, np.ndarray] = {}
        if needs_data:  # read on the reading ranks only
            self._windows = {"train": self._read(self.train_paths)}
            if self.valid_paths:
                self._windows["valid"] = self._read(self.valid_paths)

    def _read(self, paths: list[Path]) -> np.ndarray:
        """[n, s + 1] int64 windows of the token stream of `paths`."""
        ids: list[int] = []
        for path in paths:
            ids += list(self.tokenizer.encode(path.read_text(encoding="utf-8"))) + [self.tokenizer.eod]
        s = self.seq_length
        n = (len(ids) - 1) // s
        if n < 1:
            raise ValueError(f"{', '.join(map(str, paths))}: {len(ids)} tokens, fewer than one window of {s + 1}")
        stream = np.asarray(ids, dtype=np.int64)
        return np.stack([stream[j * s: j * s + s + 1] for j in range(n)])

    def window(self, split: str, g: int) -> np.ndarray:
        """Global sample `g` of `split` (train: through the epoch permutation)."""
        windows = self._windows[split]
        n = len(windows)
        epoch, j = divmod(int(g), n)
        if split == "train" and self.shuffle:
            j = int(np.random.default_rng([self.seed, epoch]).permutation(n)[j])
        return windows[j]

    def _batch(self, split: str, first: int) -> dict:
        data = torch.from_numpy(np.stack([self.window(split, g) for g in range(first, first + self.micro_batch_size)]))
        b, s = data.shape[0], self.seq_length
        return {"tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous(),
                "loss_mask": torch.ones(b, s, dtype=torch.float32),
                "position_ids": torch.arange(s, dtype=torch.int64).expand(b, s).contiguous()}

    def _stream(self, split: str, consumed: int, count: bool) -> Iterator[Optional[dict]]:
        step = self.micro_batch_size * self.dp_size
        k = 0
        while True:
            first = consumed + k * step + self.dp_rank * self.micro_batch_size
            k += 1
            if count:
                self.consumed_samples = consumed + k * step
            yield self._batch(split, first) if self.needs_data else None

    def train_iterator(self, consumed_samples: int) -> Iterator[Optional[dict]]:
        if consumed_samples % (self.micro_batch_size * self.dp_size):
            raise ValueError(f"consumed_samples={consumed_samples} is not a multiple of micro_batch_size × dp_size")
        self.consumed_samples = int(consumed_samples)
        return self._stream("train", int(consumed_samples), True)

    def eval_iterator(self, split: str) -> Iterator[Optional[dict]]:
        return self._stream(split, 0, False)

    def has_split(self, split: str) -> bool:
        return split == "train" or (split == "valid" and bool(self.valid_paths))

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}
