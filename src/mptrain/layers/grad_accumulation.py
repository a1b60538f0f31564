"""Gradient accumulation fusion: the weight-grad GEMM accumulates straight into ``main_grad``.

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
"""

from __future__ import annotations

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
