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

K-major operands under TF32 (decided at run time by `tf32_kmajor_pays`): the weight-grad GEMM contracts over
tokens, the strided dim of both row-major ``dY [T, out]`` and ``X [T, in]``, so both operands are
MN-major. Hopper's TF32 tensor-core MMA reads only K-major operands from shared memory (16-bit
types read either), so cuBLAS's TF32 kernels for this layout are markedly slower than with ``X``
K-major (bench/reports/2026-12-01-micro-benchmarks.md). So for fp32 CUDA operands
with TF32 on, `weight_grad` first copies ``Xᵀ``
to a contiguous ``[in, T]``: a Triton kernel (`transpose.transpose_copy`) for the inputs that a
column-parallel layer all-gathers itself under sequence parallelism (its async path, the default),
``.t().contiguous()`` elsewhere, which in compiled layers Inductor fuses into its recomputation of
``X`` (and then need not save the GeLU output). Copying ``dYᵀ`` as well costs about what it
saves; the Triton copy for every ``Xᵀ`` would make Inductor save the GeLU output again, hence
Triton only where ``X`` is saved anyway (end-to-end A/Bs: bench/reports/2026-11-30-megatron-core.md).
Transient memory: ``Xᵀ``, the size of the saved input. Same products, same fp32 accumulation;
only the GEMM kernel differs.
"""

from __future__ import annotations

from typing import Optional

import torch

from mptrain.layers import mixed_add
from mptrain.layers.transpose import transpose_copy


def _wgrad_accumulate(a: torch.Tensor, b_t: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += a · b_tᵀ`` (the body of the `wgrad_accumulate` op).

    Shapes: a ``[out, T]`` (``dYᵀ``), b_t ``[in, T]`` (``Xᵀ``), any strides; main_grad ``[out, in]``
    (fp32, or the inputs' dtype).
    """
    b = b_t.t()
    if main_grad.dtype == a.dtype:
        main_grad.addmm_(a, b)
    elif main_grad.is_cuda:
        torch.ops.aten.addmm.dtype_out(main_grad, a, b, main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(a.matmul(b))


# The custom op is what a compiled backward calls; an eager backward calls the body directly (the
# op's dispatch through torch.library costs ~50 us of host time a call on CPU, the same kernels).
wgrad_accumulate = torch.library.custom_op("mptrain::wgrad_accumulate", mutates_args=("main_grad",))(_wgrad_accumulate)


@wgrad_accumulate.register_fake
def _(a, b_t, main_grad) -> None:
    return None


def _add_into(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad += grad`` (the body of the `add_into` op; ``grad`` in its own dtype, added in ``main_grad``'s):
    half into fp32 on CUDA through `mixed_add.add_into`'s vectorised kernel, ``add_`` otherwise."""
    mixed_add.add_into(main_grad, grad)


# a declared mutation, as `wgrad_accumulate`: a compiled backward updates the buffer view in place
add_into = torch.library.custom_op("mptrain::main_grad_add", mutates_args=("main_grad",))(_add_into)


@add_into.register_fake
def _(main_grad, grad) -> None:
    return None


def accumulate_into(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """Add a weight grad computed elsewhere (the FP8 weight-grad GEMM, `mptrain.layers.fp8`) into its
    ``main_grad`` view: the custom op when compiling, the body otherwise."""
    (add_into if torch.compiler.is_compiling() else _add_into)(main_grad, grad)


def tf32_kmajor_pays(t: torch.Tensor) -> bool:
    """True when a weight-grad GEMM on ``t``'s dtype/device runs faster with a K-major operand: fp32 CUDA, TF32 on."""
    return t.is_cuda and t.dtype == torch.float32 and _tf32_matmul_enabled()


def _tf32_matmul_enabled() -> bool:
    """Whether fp32 CUDA matmuls may use TF32, set through either of torch's APIs.

    The legacy ``allow_tf32`` (what the trainer sets from ``precision.allow_tf32``) raises
    RuntimeError on torch >= 2.9 when TF32 was set through the newer ``fp32_precision`` API; then
    that one answers ("none" = inherit the global ``torch.backends.fp32_precision``).
    """
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        precision = torch.backends.cuda.matmul.fp32_precision
        if precision == "none":
            precision = torch.backends.fp32_precision
        return precision == "tf32"


def weight_grad(grad_output: torch.Tensor, total_input: torch.Tensor, main_grad: Optional[torch.Tensor],
                kmajor: bool, gathered_input: bool = False) -> Optional[torch.Tensor]:
    """``dW = dYᵀ X`` over all tokens: accumulated into ``main_grad`` (returns None), or returned.

    Shapes: grad_output ``[T, out]``, total_input ``[T, in]``, main_grad / result ``[out, in]``.
    ``kmajor``: copy ``Xᵀ`` to K-major layout first (see the module docstring). ``gathered_input``:
    ``X`` is a sequence-parallel all-gather's output, saved from forward; copy it with the Triton
    kernel (`transpose.transpose_copy`). Otherwise ``X`` is an activation Inductor may recompute
    in backward (GeLU output, attention context), so the copy is left to Inductor, which fuses the
    transposed write into that recomputation and then need not save ``X``.
    """
    b_t = total_input.t()  # [in, T]: a view, tokens strided
    if kmajor:
        b_t = transpose_copy(total_input) if gathered_input else b_t.contiguous()
    if main_grad is None:
        return grad_output.t().matmul(b_t.t())
    (wgrad_accumulate if torch.compiler.is_compiling() else _wgrad_accumulate)(grad_output.t(), b_t, main_grad)
    return None
