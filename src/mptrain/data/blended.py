"""A weighted blend of sample sources (Megatron's `BlendedDataset`), extendable without limit.

Megatron picks, for blended sample i, the dataset with the largest error w_k·(i+1) − count_k,
over a number of samples fixed in advance. We use the closed form of the same idea (Webster /
Sainte-Laguë apportionment): dataset k's m-th sample gets the virtual time (m + ½) / w_k, and the
blend serves samples in increasing time (ties: lower k first). The first N entries never depend
on N, so asking for more samples extends the same order, and after N samples every count_k is
within 1 of w_k·N. Example, weights [0.75, 0.25]: times of dataset 0 are 0.67, 2, 3.33, 4.67,
6, 7.33, ...; of dataset 1: 2, 6, 10, ...; so the blend serves datasets 0 0 1 0 0 0 1 0 ...
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mptrain.data.collate import read_samples
from mptrain.errors import ConfigError


def blend_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `num_samples` entries of the blend.

    Args:
        weights: positive weights (normalised here).
        num_samples: how many entries.
    Returns:
        dataset_index int64 [num_samples], dataset_sample_index int64 [num_samples].
    Raises:
        ConfigError: a weight <= 0 (names `data.prefixes`).
    """
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or np.any(w <= 0):
        raise ConfigError(f"data.prefixes: blend weights {list(weights)} must be positive; drop the prefix instead")
    w = w / w.sum()
    k_count = len(w)
    times, ks, ms = [], [], []
    for k, wk in enumerate(w):
        # Enough entries: the N-th time is <= N + K/2, and dataset k has <= w_k (N + K) + 1 times below it.
        m = np.arange(int(wk * (num_samples + k_count)) + 2, dtype=np.int64)
        times.append((m + 0.5) / wk)
        ks.append(np.full(len(m), k, dtype=np.int64))
        ms.append(m)
    t, k, m = np.concatenate(times), np.concatenate(ks), np.concatenate(ms)
    order = np.lexsort((k, t))[:num_samples]
    return k[order], m[order]


class BlendedDataset:
    """Sample i of the blend = sample `dataset_sample_index[i]` of `datasets[dataset_index[i]]`.

    Args:
        datasets: sources with `sample(index) -> (tokens [s+1], valid [s+1])`.
        weights: one positive weight per source.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float]) -> None:
        if len(datasets) != len(weights):
            raise ConfigError(f"data.prefixes: {len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = [float(x) for x in weights]
        self._size = 0
        self._dataset_index = np.zeros(0, dtype=np.int64)
        self._dataset_sample_index = np.zeros(0, dtype=np.int64)

    def locate(self, index: int) -> tuple[int, int]:
        """(dataset, sample within it) of blended sample `index`; grows the table by doubling."""
        if index >= self._size:
            size = max(1024, self._size)
            while size <= index:
                size *= 2
            self._dataset_index, self._dataset_sample_index = blend_indices(self.weights, size)
            self._size = size
        return int(self._dataset_index[index]), int(self._dataset_sample_index[index])

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Blended sample `index`: tokens int64 [s + 1], valid bool [s + 1]."""
        k, j = self.locate(int(index))
        return self.datasets[k].sample(j)

    def sample_batch(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Blended samples `indices`, equal to stacking `sample`: each dataset's share read in one call
        (`read_samples`); b >= 1. tokens int64 [b, s + 1], valid bool [b, s + 1]."""
        located = np.array([self.locate(int(i)) for i in indices], dtype=np.int64).reshape(-1, 2)
        tokens = valid = None
        for k in np.unique(located[:, 0]).tolist():
            rows = np.flatnonzero(located[:, 0] == k)
            t, v = read_samples(self.datasets[k], located[rows, 1].tolist())
            if tokens is None:
                tokens = np.empty((len(located), t.shape[1]), dtype=np.int64)
                valid = np.empty((len(located), t.shape[1]), dtype=bool)
            tokens[rows], valid[rows] = t, v
        return tokens, valid
