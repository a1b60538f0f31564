#!/usr/bin/env python3
"""``fp32 main_grad += bf16 dW`` on one GPU: torch's ``add_`` against `mptrain.layers.mixed_add.add_into`'s
Triton kernel, for the weight shapes of one gpt_1.3b layer (the FP8 weight-grad path adds one per linear and
micro-batch).

    PYTHONPATH=src python bench/mixed_add.py [--iters 200]

Prints one JSON row per shape: microseconds per call (CUDA events, median of 5 passes) each way, and the
kernel's effective bandwidth (10 bytes an element: read fp32 and bf16, write fp32). The calls cycle through
enough buffer pairs (≥ 256 MiB in all) that neither operand is still in L2 from the call before, as in
training, where ``main_grad`` was last touched a micro-batch ago.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mptrain.layers import mixed_add

SHAPES = {"qkv": (6144, 2048), "proj": (2048, 2048), "fc1": (8192, 2048), "fc2": (2048, 8192)}


def per_call_us(fn, pairs: list, iters: int) -> float:
    passes = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(*pairs[i % len(pairs)])
        end.record()
        torch.cuda.synchronize()
        passes.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(passes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    for name, shape in SHAPES.items():
        numel = shape[0] * shape[1]
        pairs = [(torch.zeros(shape, device="cuda"), torch.randn(shape, device="cuda").bfloat16())
                 for _ in range(max(2, -(-256 * 2**20 // (6 * numel))))]
        mixed_add.add_into(*pairs[0])  # compile the kernel before timing
        torch_us = per_call_us(lambda m, g: m.add_(g), pairs, a.iters)
        kernel_us = per_call_us(mixed_add.add_into, pairs, a.iters)
        print(json.dumps({"shape": name, "elements": numel, "add_us": round(torch_us, 1),
                          "kernel_us": round(kernel_us, 1), "speedup": round(torch_us / kernel_us, 2),
                          "kernel_tb_per_s": round(numel * 10 / kernel_us / 1e6, 2),
                          "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
