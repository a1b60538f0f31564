"""Micro-benchmark: GEMM throughput by operand layout for a linear layer's three GEMMs.

For each ``[out, in]`` weight at ``T`` tokens it times, on one GPU, in the given dtype:

* ``fwd``      ``Y = X Wᵀ``           (both operands K-major)
* ``dgrad``    ``dX = dY W``          (W is N-major)
* ``dgrad_t``  ``dX = dY (Wᵀ)ᵀ``      with ``Wᵀ`` made contiguous first (copy timed)
* ``wgrad``    ``G += dYᵀ X``         (both operands MN-major: K = tokens is the strided dim)
* ``wgrad_t``  ``G += (dYᵀ)(Xᵀ)ᵀ``    with both transposes made contiguous first (copies timed)

Why: Hopper's TF32 tensor-core MMA reads only K-major operands from shared memory, so cuBLAS's
MN-major TF32 kernels are slower; 16-bit types have no such restriction. Prints one JSON row per
(shape, op) with ms and TFLOP/s.

Usage: ``python bench/gemm_layouts.py --dtype fp32 --tokens 8192 --shapes 6144x4096,8192x4096``
"""

from __future__ import annotations

import argparse
import json

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def time_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` CUDA-event-timed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shapes", default="6144x4096,4096x2048,8192x4096,4096x8192,25128x4096",
                        help="comma-separated OUTxIN weight shapes")
    parser.add_argument("--no-tf32", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = not args.no_tf32
    dtype, t = DTYPES[args.dtype], args.tokens
    gpu = torch.cuda.get_device_name()
    for shape in args.shapes.split(","):
        out, inp = (int(v) for v in shape.split("x"))
        x = torch.randn(t, inp, device="cuda", dtype=dtype)
        w = torch.randn(out, inp, device="cuda", dtype=dtype)
        dy = torch.randn(t, out, device="cuda", dtype=dtype)
        g = torch.zeros(out, inp, device="cuda", dtype=dtype)
        ops = {
            "fwd": lambda: x.matmul(w.t()),
            "dgrad": lambda: dy.matmul(w),
            "dgrad_t": lambda: dy.matmul(w.t().contiguous().t()),
            "wgrad": lambda: g.addmm_(dy.t(), x),
            "wgrad_t": lambda: g.addmm_(dy.t().contiguous(), x.t().contiguous().t()),
            "transpose_dy": lambda: dy.t().contiguous(),
            "transpose_x": lambda: x.t().contiguous(),
        }
        flop = 2.0 * t * out * inp
        for name, fn in ops.items():
            ms = time_ms(fn)
            row = {"gpu_name": gpu, "dtype": args.dtype, "tf32": not args.no_tf32, "tokens": t,
                   "out": out, "in": inp, "op": name, "ms": round(ms, 4)}
            if not name.startswith("transpose"):
                row["tflops"] = round(flop / ms / 1e9, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
