"""Transposed copy ``[M, N] -> [N, M]`` (contiguous) with a tiled Triton kernel on CUDA.

Used for the K-major ``Xᵀ`` operand of the TF32 weight-grad GEMM (`grad_accumulation.weight_grad`).
Inside the compiled transformer layers Inductor's own transposed copies of these ``[T, h]``
activations, and torch's copy kernel, reach well under half the HBM bandwidth that a plain
64 × 64-tile kernel does (bench/reports/2026-12-01-micro-benchmarks.md). The
kernel is a ``torch.library.triton_op``, so Inductor
keeps it in the compiled graph. For CPU tensors, or without Triton (CPU builds of torch):
``x.t().contiguous()``.
"""

from __future__ import annotations

import importlib.util

import torch

_BLOCK = 64

# The package check, not torch's has_triton(): that one queries the GPU, which would initialise
# CUDA at import time (before each rank picks its device; forked children could not use CUDA).
if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _transpose_kernel(src, dst, m, n, stride_m, stride_n, BLOCK: tl.constexpr):
        rm = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        rn = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        tile = tl.load(src + rm[:, None] * stride_m + rn[None, :] * stride_n,
                       mask=(rm[:, None] < m) & (rn[None, :] < n))
        tl.store(dst + rn[:, None] * m + rm[None, :], tl.trans(tile), mask=(rn[:, None] < n) & (rm[None, :] < m))

    @torch.library.triton_op("mptrain::transpose_copy", mutates_args=())
    def _transpose_copy_cuda(x: torch.Tensor) -> torch.Tensor:
        m, n = x.shape
        out = torch.empty((n, m), device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(m, _BLOCK), triton.cdiv(n, _BLOCK))
        torch.library.wrap_triton(_transpose_kernel)[grid](x, out, m, n, x.stride(0), x.stride(1), BLOCK=_BLOCK,
                                                           num_warps=4)
        return out
else:
    _transpose_copy_cuda = None


def transpose_copy(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a 2-D ``x`` ``[M, N]`` (any strides): returns ``[N, M]``, row-major."""
    if x.is_cuda and _transpose_copy_cuda is not None:
        return _transpose_copy_cuda(x)
    return x.t().contiguous()
