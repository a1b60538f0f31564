"""Mock data (DESIGN.md §1): learnable synthetic sequences, no files.

Sample i of a split is `(start + arange(s + 1)) mod vocab_size` with `start` a hash of
(data.seed, split, i) — consecutive ids from a seeded start, so a model can learn "next id =
this id + 1" (the loss falls quickly) and any layout sees the same numbers. Train, valid and
test use different hash inputs, so they differ. Infinite: any index is a sample.
(Megatron's `MockGPTDataset` serves arange-like documents of random length for the same purpose.)
"""

from __future__ import annotations

import numpy as np

from mptrain.data.gpt_dataset import SPLITS
from mptrain.errors import ConfigError

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al., "Fast splittable pseudorandom number generators",
    OOPSLA 2014): a bijective 64-bit mix of uint64 values."""
    with np.errstate(over="ignore"):
        z = (np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class MockDataset:
    """Consecutive ids mod `vocab_size` from a seeded start per sample.

    Args:
        vocab_size: `data.vocab_size`; ids are in [0, vocab_size).
        seq_length: s; samples hold s + 1 tokens.
        seed: `data.seed`.
        split: "train" | "valid" | "test".
    Raises:
        ConfigError: vocab_size < 2.
    """

    num_samples_per_epoch = None  # infinite

    def __init__(self, *, vocab_size: int, seq_length: int, seed: int, split: str) -> None:
        if vocab_size < 2:
            raise ConfigError(f"data.vocab_size={vocab_size} must be >= 2 for mock data")
        self.vocab_size, self.seq_length, self.seed, self.split = int(vocab_size), int(seq_length), int(seed), split
        # Distinct 64-bit keys per (seed, split): the sample index is mixed in below.
        self._key = splitmix64(np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF) ^ splitmix64(np.uint64(SPLITS.index(split) + 1)))

    def start(self, index: int) -> int:
        """The first id of sample `index`."""
        with np.errstate(over="ignore"):
            return int(splitmix64(self._key ^ splitmix64(np.uint64(index))) % np.uint64(self.vocab_size))

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample `index`: tokens int64 [s + 1], valid bool [s + 1] (all True)."""
        tokens = (self.start(index) + np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return tokens, np.ones(self.seq_length + 1, dtype=bool)

    def sample_batch(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Samples `indices` (b of them) in one vectorised computation, equal to stacking `sample`:
        tokens int64 [b, s + 1], valid bool [b, s + 1] (all True)."""
        idx = np.asarray(indices, dtype=np.int64).astype(np.uint64)
        with np.errstate(over="ignore"):
            starts = (splitmix64(self._key ^ splitmix64(idx)) % np.uint64(self.vocab_size)).astype(np.int64)
        tokens = (starts[:, None] + np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return tokens, np.ones(tokens.shape, dtype=bool)
