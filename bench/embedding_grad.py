#!/usr/bin/env python3
"""Embedding forward + backward time on the GPU for the shipped Shakespeare corpus's byte tokens against uniform
random tokens (64 × 256 tokens, h = 384, V = 257: the ``s_6x384_v257`` rows' shape), three ways: eager
``F.embedding``, the same compiled by Inductor, and the weight grad as a one-hot GEMM (``one_hot(ids)ᵀ · dY``).

    PYTHONPATH=src python bench/embedding_grad.py

Prints one JSON row per way: microseconds per call on real and on uniform tokens (mean of 50 calls after 3).
Question it answers: does real text's skewed token distribution (few distinct bytes, so many tokens add into the
same embedding rows) slow the weight grad's scatter-add?
"""

from __future__ import annotations

import gzip
import json
import time

import torch
import torch.nn.functional as F

from mptrain.resources import shipped_corpus

V, H, S, B = 257, 384, 256, 64


def main() -> None:
    torch.manual_seed(0)
    text = "".join(json.loads(line)["text"] for line in gzip.open(shipped_corpus(), "rt"))
    raw = torch.frombuffer(bytearray(text.encode()[: S * B * 20]), dtype=torch.uint8).long()
    dev = "cuda"
    weight = torch.randn(V, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(S, B, H, device=dev, dtype=torch.bfloat16)

    def scatter(ids):
        F.embedding(ids, weight).backward(grad_out)

    def one_hot(ids):
        F.embedding(ids, weight)
        return (F.one_hot(ids.reshape(-1), V).to(torch.bfloat16).t() @ grad_out.reshape(-1, H)).float()

    def per_call_us(fn, batches, n=50):
        for ids in batches[:3]:
            fn(ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(n):
            fn(batches[i % len(batches)])
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    real = [raw[i * S * B:(i + 1) * S * B].reshape(S, B).to(dev) for i in range(20)]
    uniform = [torch.randint(0, V, (S, B), device=dev) for _ in range(20)]
    for name, fn in (("eager", scatter), ("compiled", torch.compile(scatter)), ("one_hot_gemm", one_hot)):
        print(json.dumps({"way": name, "real_us": round(per_call_us(fn, real), 1),
                          "uniform_us": round(per_call_us(fn, uniform), 1),
                          "distinct_real_tokens": int(torch.unique(real[0]).numel())}))


if __name__ == "__main__":
    main()
