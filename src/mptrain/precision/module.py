"""`Float16Module`: run a model chunk in fp16 / bf16 (Megatron `Float16Module`, megatron/core/transformer/module.py).

Wrapping order (docs/ARCHITECTURE.md): ``DDP(Float16Module(GPTModel))``. The wrapper

- casts every parameter and buffer of the chunk to ``dtype`` once, at construction;
- on the first pipeline stage casts floating-point inputs to ``dtype`` (token / position ids
  and boolean masks are left alone);
- on the last pipeline stage returns floating-point outputs as fp32, so the loss (and anything
  reduced from it) is computed and reported in fp32. (Our GPT chunk already returns the
  per-token loss [b, s] in fp32 from the vocab-parallel cross entropy; logits [b, s, V/tp] are
  upcast here.)

Middle stages receive activations [s, b, h] in ``dtype`` through `set_input_tensor` (the p2p
buffers are allocated in the model dtype) and pass them through unchanged.

`round_params_to` gives an fp32 chunk that keeps its params in fp32 (ZeRO-2 / ZeRO-3, whose sharded params are the
master weights) the values this cast leaves behind, so that its master weights start where the mixed-precision
optimizer's fp32 main params (``param.float()`` of the cast params) start.
"""

from __future__ import annotations

from typing import Any

import torch

from mptrain.layers.dtypes import HALF_DTYPES


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in a (nested) tuple / list / dict to ``dtype``; other leaves unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module under model wrappers (`Float16Module`, `DistributedDataParallel`): each
    holds the module it wraps as ``.module``; returns the model chunk (e.g. `GPTModel`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def round_params_to(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every floating-point parameter of ``module`` through ``dtype`` once, in place, keeping its dtype:
    ``p = p.to(dtype).to(p.dtype)``.

    The params `Float16Module` casts are all of the chunk's floating-point params (``module.to(dtype)``; the
    router's fp32 buffers are buffers, not params), and the mixed-precision optimizer's fp32 main param of each is
    its cast value upcast (Megatron: ``Float16Module`` + ``Float16OptimizerWithFloat16Params``' ``param.float()``),
    so an fp32 master weight rounded here starts from the same value. Call it on a fresh init only: a checkpoint
    loaded afterwards overwrites the params with its own (main) values.

    Args:
        module: the model chunk, any param shapes (fp32 params: the master weights).
        dtype: torch.float16 or torch.bfloat16 (the compute dtype).
    Raises:
        ValueError: ``dtype`` is not fp16 / bf16.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"round_params_to: dtype={dtype} must be torch.float16 or torch.bfloat16")
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point():
                param.copy_(param.to(dtype))


class Float16Module(torch.nn.Module):
    """A model chunk with fp16/bf16 parameters, fp16/bf16 first-stage inputs and fp32 last-stage outputs.

    Args:
        module: the chunk (e.g. `GPTModel`); cast in place to ``dtype``.
        dtype: torch.float16 or torch.bfloat16.
        is_first_stage: cast floating-point forward inputs to ``dtype``.
        is_last_stage: return floating-point outputs as fp32.
    Raises:
        ValueError: ``dtype`` is not fp16 / bf16 (fp32 runs use the chunk unwrapped).
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, *, is_first_stage: bool, is_last_stage: bool) -> None:
        super().__init__()
        if dtype not in HALF_DTYPES:
            raise ValueError(f"Float16Module: dtype={dtype} must be torch.float16 or torch.bfloat16 (fp32 needs no wrapper)")
        self.module = module.to(dtype)
        self.dtype = dtype
        self.is_first_stage = is_first_stage
        self.is_last_stage = is_last_stage

    def set_input_tensor(self, input_tensor) -> None:
        """Pass the previous stage's activations [s(/tp), b, h] to the wrapped chunk."""
        self.module.set_input_tensor(input_tensor)

    def forward(self, *args, **kwargs):
        if self.is_first_stage:
            args = _cast_floats(args, self.dtype)
            kwargs = _cast_floats(kwargs, self.dtype)
        out = self.module(*args, **kwargs)
        if self.is_last_stage:
            out = _cast_floats(out, torch.float32)
        return out
