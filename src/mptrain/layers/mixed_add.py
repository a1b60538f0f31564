"""``main_grad += grad`` for an fp32 ``main_grad`` and a bf16 / fp16 ``grad``, with a Triton kernel on CUDA.

Used where a weight grad is formed outside the weight-grad GEMM's epilogue and then added into its fp32
``main_grad`` view: the FP8 weight-grad GEMM (``torch._scaled_mm`` has no β = 1 accumulation) returns a
bf16 ``dW`` that `grad_accumulation.accumulate_into` adds in, once per linear and micro-batch. torch's
``add_`` runs mixed-dtype operands through its unrolled (not vectorised) elementwise kernel; the plain
1-D kernel here reads 16-byte vectors of both (bench/reports/2026-12-04-fp8-weight-cache.md measures both).
Same arithmetic as ``main_grad.add_(grad)``: each element is ``fp32(main_grad) + fp32(grad)``, rounded
once to fp32, so the result is bitwise equal (tests/test_gpu_kernels.py).

CPU tensors, other dtypes, non-contiguous operands, or no Triton (CPU builds of torch): ``add_``.
"""

from __future__ import annotations

import importlib.util

import torch

_BLOCK = 2048  # elements per program: 16 per thread at 4 warps (four 16-byte fp32 vectors, two bf16 ones)

# The package check, not torch's has_triton(): that one queries the GPU (see `transpose`).
if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_into_fp32_kernel(acc, src, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(acc + offs, mask=mask)
        b = tl.load(src + offs, mask=mask).to(tl.float32)
        tl.store(acc + offs, a + b, mask=mask)
else:
    _add_into_fp32_kernel = None


def _kernel_applies(main_grad: torch.Tensor, grad: torch.Tensor) -> bool:
    return (_add_into_fp32_kernel is not None and main_grad.is_cuda and main_grad.dtype == torch.float32
            and grad.dtype in (torch.bfloat16, torch.float16) and grad.device == main_grad.device
            and grad.shape == main_grad.shape and main_grad.is_contiguous() and grad.is_contiguous())


def add_into(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad += grad`` in place.

    Shapes: any, equal. main_grad fp32 (the kernel's case) or any dtype ``add_`` accepts; grad bf16 /
    fp16 for the kernel. Call it outside compiled code, or from a custom op's body (it launches a Triton
    kernel directly, not through Inductor), with ``main_grad``'s device current (Triton launches there; each
    trainer rank sets its own).
    """
    n = main_grad.numel()
    if n == 0:
        return
    if not _kernel_applies(main_grad, grad):
        main_grad.add_(grad)
        return
    _add_into_fp32_kernel[(triton.cdiv(n, _BLOCK),)](main_grad, grad, n, BLOCK=_BLOCK, num_warps=4)
