"""Micro-benchmark: GEMM throughput by operand layout for a linear layer's three GEMMs.

For each ``[out, in]`` weight at ``T`` tokens it times, on one GPU, in the given dtype:

* ``fwd``      ``Y = X Wᵀ``           (both operands K-major)
* ``dgrad``    ``dX = dY W``          (W is N-major)
* ``dgrad_t``  ``dX = dY (Wᵀ)ᵀ``      with ``Wᵀ`` made contiguous first (copy timed)
* ``wgrad``    ``G += dYᵀ X``         (both operands MN-major: K = tokens is the strided dim)
* ``wgrad_t``  ``G += (dYᵀ)(Xᵀ)ᵀ``    with both transposes made contiguous first (copies timed)
* ``wgrad_kmajor_only`` / ``wgrad_dyt_only`` / ``wgrad_xt_only``: the GEMM alone on both / one
  K-major operand (copies made beforehand)
* ``transpose_*``: the copies alone (torch's copy kernel; Inductor's, default and coordinate-descent tuned)

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


def _triton_transpose():
    """A plain tiled Triton transpose ``[M, N] -> [N, M]`` (reference for what the copy can reach), or None."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(src, dst, M, N, BLOCK: tl.constexpr):
        rm = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tile = tl.load(src + rm[:, None] * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N))
        tl.store(dst + rn[:, None] * M + rm[None, :], tl.trans(tile), mask=(rn[:, None] < N) & (rm[None, :] < M))

    def run(t, block, warps):
        m, n = t.shape
        out = t.new_empty(n, m)
        kernel[(triton.cdiv(m, block), triton.cdiv(n, block))](t, out, m, n, BLOCK=block, num_warps=warps)
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shapes", default="6144x4096,4096x2048,8192x4096,4096x8192,25128x4096",
                        help="comma-separated OUTxIN weight shapes")
    parser.add_argument("--no-tf32", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "gemm_layouts: needs a CUDA GPU (run it on a GPU machine)\n")
    torch.backends.cuda.matmul.allow_tf32 = not args.no_tf32
    dtype, t = DTYPES[args.dtype], args.tokens
    gpu = torch.cuda.get_device_name()

    def transpose(t):
        return t.t().contiguous()

    compiled_t = torch.compile(transpose, dynamic=False)
    # coordinate-descent tuning of the block sizes (Inductor's coordinate_descent_tuning)
    compiled_t_cdt = torch.compile(transpose, dynamic=False, options={"coordinate_descent_tuning": True})
    triton_t = _triton_transpose()
    for shape in args.shapes.split(","):
        out, inp = (int(v) for v in shape.split("x"))
        x = torch.randn(t, inp, device="cuda", dtype=dtype)
        w = torch.randn(out, inp, device="cuda", dtype=dtype)
        dy = torch.randn(t, out, device="cuda", dtype=dtype)
        g = torch.zeros(out, inp, device="cuda", dtype=dtype)
        dyt, xt = dy.t().contiguous(), x.t().contiguous()
        ops = {
            "fwd": lambda: x.matmul(w.t()),
            "dgrad": lambda: dy.matmul(w),
            "dgrad_t": lambda: dy.matmul(w.t().contiguous().t()),
            "wgrad": lambda: g.addmm_(dy.t(), x),
            "wgrad_t": lambda: g.addmm_(dy.t().contiguous(), x.t().contiguous().t()),
            "wgrad_kmajor_only": lambda: g.addmm_(dyt, xt.t()),  # both copies made beforehand (not timed)
            "wgrad_dyt_only": lambda: g.addmm_(dyt, x),  # only dYᵀ K-major (copy not timed)
            "wgrad_xt_only": lambda: g.addmm_(dy.t(), xt.t()),  # only Xᵀ K-major (copy not timed)
            "transpose_dy": lambda: dy.t().contiguous(),
            "transpose_x": lambda: x.t().contiguous(),
            "transpose_dy_inductor": lambda: compiled_t(dy),
            "transpose_dy_inductor_cdt": lambda: compiled_t_cdt(dy),
            **({f"transpose_dy_triton{b}x{w}": (lambda b=b, w=w: triton_t(dy, b, w)) for b in (32, 64, 128) for w in (4, 8)}
               if triton_t else {}),
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
