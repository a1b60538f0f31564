#!/usr/bin/env python3
"""Host time to read one micro-batch: sample by sample (``sample(i)`` stacked) against ``read_samples`` (one
vectorised ``sample_batch`` call), for mock data and for the shipped Shakespeare corpus (byte tokenizer).

    PYTHONPATH=src python bench/data_read.py [--micro-batch-size 64] [--seq-length 256] [--batches 300]

Prints one JSON row per dataset: microseconds per micro-batch (median of 5 passes) each way and their ratio.
The read runs in the prefetch thread on CUDA, holding the GIL while it runs Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

from mptrain.data.collate import read_samples
from mptrain.data.gpt_dataset import GPTDataset
from mptrain.data.indexed import IndexedDataset
from mptrain.data.mock import MockDataset
from mptrain.data.preprocess import preprocess
from mptrain.data.tokenizers import ByteTokenizer
from mptrain.resources import shipped_corpus


def per_batch_us(read, batches: int, mbs: int) -> float:
    passes = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(batches):
            read(range(i * mbs, (i + 1) * mbs))
        passes.append((time.perf_counter() - t) / batches * 1e6)
    return statistics.median(passes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch-size", type=int, default=64)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--batches", type=int, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = f"{tmp}/shakespeare"
        preprocess([str(shipped_corpus())], output_prefix=prefix, tokenizer=ByteTokenizer(), workers=1, overwrite=True,
                   progress=False)
        datasets = {
            "mock": MockDataset(vocab_size=257, seq_length=a.seq_length, seed=1234, split="train"),
            "shakespeare": GPTDataset(IndexedDataset(prefix), doc_range=(0, 38), seq_length=a.seq_length, seed=1234,
                                      split="train", shuffle=True, eod=256),
        }
        for name, ds in datasets.items():
            stacked = per_batch_us(lambda idx: np.stack([ds.sample(i)[0] for i in idx]), a.batches, a.micro_batch_size)
            batched = per_batch_us(lambda idx: read_samples(ds, idx), a.batches, a.micro_batch_size)
            print(json.dumps({"dataset": name, "micro_batch_size": a.micro_batch_size, "seq_length": a.seq_length,
                              "per_sample_us": round(stacked, 1), "read_samples_us": round(batched, 1),
                              "speedup": round(stacked / batched, 2)}))


if __name__ == "__main__":
    main()
