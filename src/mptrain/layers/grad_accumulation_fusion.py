"""How the data-parallel wrapper finds the layers that accumulate their own weight grads into ``main_grad``.

Megatron's ``gradient_accumulation_fusion``: a layer's backward adds ``dW`` into the weight's fp32
``main_grad`` (a view of the DDP wrapper's contiguous grad buffer) inside the weight-grad GEMM and
returns no weight grad (`mptrain.layers.grad_accumulation`). Under
``parallel.gradient_accumulation_fusion`` `mptrain.distributed.DistributedDataParallel` calls
``fuse_grad_accumulation(main_grad)`` once on every submodule that implements
`FusesGradAccumulation`, and on no other: it finds fusion targets through this method only, so a
user's plugged-in linear (or model) gets fusion by implementing it. A layer without the method
keeps autograd's ``param.grad``, which the wrapper's hook adds into the buffer.

Implemented by `ColumnParallelLinear`, `RowParallelLinear` (their ``weight``) and `GPTModel` (the
weight its output layer multiplies by: its own, or the tied word embedding's).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

MainGradOf = Callable[[torch.nn.Parameter], Optional[torch.Tensor]]
"""``main_grad(param)``: the param's ``main_grad`` view (shaped like it, in the buffer's dtype), or None
when the wrapper holds no grad for it (``requires_grad=False``: leave that weight on the unfused path)."""


@runtime_checkable
class FusesGradAccumulation(Protocol):
    """A module whose backward accumulates some of its weight grads into ``main_grad`` itself."""

    def fuse_grad_accumulation(self, main_grad: MainGradOf) -> None:
        """Take ``main_grad(w)`` for each weight ``w`` whose grad this module's backward will add
        into that view from now on (returning None as that weight's grad, e.g. through
        `mptrain.layers.linear.linear` / `column_parallel_linear` with ``main_grad=``); a None view
        means: keep that weight's grad as autograd's ``param.grad``. Called once, when the wrapper is built."""
        ...
