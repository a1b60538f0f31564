"""The weight-grad GEMM ``dW = dYᵀ X``: gradient accumulation fusion and, under TF32, K-major operands.

Megatron's ``gradient_accumulation_fusion`` (apex ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``,
used by ``LinearWithGradAccumulationAndAsyncCommunication``, which `mptrain.layers.linear` has
under the same name and which calls `wgrad_accumulate`). Without it, autograd allocates each
weight grad ``[out, in]``, and the DDP hook adds it into the fp32 ``main_grad`` buffer view: one
extra read-read-write pass over every weight per micro-batch, plus the transient grad tensor.
With it, the linear layer's backward computes ``main_grad += dYᵀ X`` in the GEMM's epilogue (β = 1)
and returns no weight grad.

* Same dtype (fp32 params, or half params with half grads): ``main_grad.addmm_``.
* Half inputs into an fp32 ``main_grad`` on CUDA: ``aten::addmm.dtype_out`` (bf16/fp16 × → fp32,
  accumulated in fp32 without rounding the product to half first). CPU has no such kernel: there
  the product is formed in the input dtype and added (the unfused arithmetic).

The accumulation is a torch custom op that declares its mutation of ``main_grad``, so that under
``model.compile_layers`` Inductor calls it in place on the buffer view (no copy back).

Readiness for the DDP wrapper's overlapped reduction needs nothing extra: autograd still runs the
weight's AccumulateGrad node (with an undefined grad) after this backward, so its
``register_post_accumulate_grad_hook`` fires with ``param.grad is None`` after the accumulation,
eager and compiled alike (tests/test_grad_accumulation.py checks the launch timing).

K-major operands under TF32 (``parallel.tf32_wgrad_transpose``): the weight-grad GEMM contracts over
tokens, the strided dim of both row-major ``dY [T, out]`` and ``X [T, in]``, so both operands are
MN-major. Hopper's TF32 tensor-core MMA reads only K-major operands from shared memory (16-bit
types read either), and cuBLAS's MN-major TF32 kernels run at ~230 TFLOP/s against ~400 for the
same GEMM K-major on an H200 (``bench/gemm_layouts.py``). So for fp32 CUDA operands with TF32 on,
`weight_grad` first copies ``dYᵀ`` and ``Xᵀ`` to contiguous ``[out, T]`` / ``[in, T]``: inside
compiled layers Inductor emits those copies (fusing them where it can), elsewhere torch's copy
kernel does. Transient memory: ``Xᵀ`` (the size of the saved input) plus ``dYᵀ`` in row chunks of
at most `KMAJOR_CHUNK_BYTES`. Same products, same fp32 accumulation; only the GEMM kernel differs.
"""

from __future__ import annotations

from typing import Optional

import torch

KMAJOR_CHUNK_BYTES = 256 * 2**20
"""Largest transient ``dYᵀ`` chunk of a K-major weight-grad GEMM (bytes); bigger outputs go in row chunks."""


@torch.library.custom_op("mptrain::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(a: torch.Tensor, b_t: torch.Tensor, main_grad: torch.Tensor, row_start: int = 0) -> None:
    """``main_grad[row_start : row_start + rows] += a · b_tᵀ``.

    Shapes: a ``[rows, T]`` (``dYᵀ``), b_t ``[in, T]`` (``Xᵀ``), any strides; main_grad ``[out, in]``
    (fp32, or the inputs' dtype). Mutating the whole buffer (not a slice view) keeps the op in
    place under Inductor.
    """
    target = main_grad.narrow(0, row_start, a.shape[0])
    b = b_t.t()
    if target.dtype == a.dtype:
        target.addmm_(a, b)
    elif target.is_cuda:
        torch.ops.aten.addmm.dtype_out(target, a, b, target.dtype, out=target)
    else:
        target.add_(a.matmul(b))


@wgrad_accumulate.register_fake
def _(a, b_t, main_grad, row_start=0) -> None:
    return None


def tf32_kmajor_pays(t: torch.Tensor) -> bool:
    """True when a weight-grad GEMM on ``t``'s dtype/device runs faster on K-major copies: fp32 CUDA with TF32 on."""
    return t.is_cuda and t.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def weight_grad(grad_output: torch.Tensor, total_input: torch.Tensor, main_grad: Optional[torch.Tensor],
                kmajor: bool) -> Optional[torch.Tensor]:
    """``dW = dYᵀ X`` over all tokens: accumulated into ``main_grad`` (returns None), or returned.

    Shapes: grad_output ``[T, out]``, total_input ``[T, in]``, main_grad / result ``[out, in]``.
    ``kmajor``: copy the operands to K-major layout first (see the module docstring), ``dYᵀ`` in
    row chunks of at most `KMAJOR_CHUNK_BYTES`.
    """
    if not kmajor:
        if main_grad is None:
            return grad_output.t().matmul(total_input)
        wgrad_accumulate(grad_output.t(), total_input.t(), main_grad)
        return None
    tokens, out = grad_output.shape
    b_t = total_input.t().contiguous()  # [in, T], tokens contiguous
    chunks = -(-out * tokens * grad_output.element_size() // KMAJOR_CHUNK_BYTES)
    rows = -(-out // chunks)  # even chunks: [25128, T] -> 4 × 6282, not 3 × 8192 + 552
    parts = []
    for start in range(0, out, rows):
        a = grad_output[:, start:start + rows].t().contiguous()  # [rows, T], tokens contiguous
        if main_grad is None:
            parts.append(a.matmul(b_t.t()))
        else:
            wgrad_accumulate(a, b_t, main_grad, start)
    if main_grad is not None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)
