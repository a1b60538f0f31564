"""Gradient accumulation fusion: the weight-grad GEMM accumulates straight into ``main_grad``.

Megatron's ``gradient_accumulation_fusion`` (apex ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``,
used by ``LinearWithGradAccumulationAndAsyncCommunication``). Without it, autograd allocates each
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
"""

from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("mptrain::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(grad_output: torch.Tensor, total_input: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_outputᵀ · total_input`` over all tokens.

    Shapes: grad_output ``[s, b, out]``, total_input ``[s, b, in]`` (any leading dims, flattened to
    tokens), main_grad ``[out, in]`` (fp32, or the inputs' dtype).
    """
    go = grad_output.reshape(-1, grad_output.shape[-1]).t()  # [out, tokens]
    x = total_input.reshape(-1, total_input.shape[-1])  # [tokens, in]
    if main_grad.dtype == go.dtype:
        main_grad.addmm_(go, x)
    elif main_grad.is_cuda:
        torch.ops.aten.addmm.dtype_out(main_grad, go, x, main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(go.matmul(x))


@wgrad_accumulate.register_fake
def _(grad_output, total_input, main_grad) -> None:
    return None


class LinearWithGradAccumulation(torch.autograd.Function):
    """``Y = X Wᵀ`` (+ b) whose backward accumulates ``dYᵀ X`` into ``main_grad`` and returns no weight grad.

    Shapes: x ``[s, b, in]``, weight ``[out, in]``, bias ``[out]`` or None, main_grad ``[out, in]``.
    ``main_grad`` rides on ctx rather than in ``save_for_backward``: it is a view of a buffer that
    other views mutate during backward, which would trip autograd's saved-tensor version check.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad, ctx.has_bias = main_grad, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            wgrad_accumulate(grad_out, x, ctx.main_grad)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_in, None, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           main_grad: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear``, with the weight grad fused into ``main_grad`` when one is given and grads are on."""
    if main_grad is not None and torch.is_grad_enabled() and weight.requires_grad:
        return LinearWithGradAccumulation.apply(x, weight, bias, main_grad)
    return torch.nn.functional.linear(x, weight, bias)
