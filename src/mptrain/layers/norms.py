"""LayerNorm / RMSNorm (torch implementations) with their sharding specs.

Norm params are replicated over TP. Under sequence parallelism each TP rank normalises a
different sequence slice ``[s/tp, b, h]``, so its weight/bias grads are partial sums: their spec
says ``sequence_parallel_grad`` and ``finalize_model_grads`` all-reduces them over TP
(Korthikanti et al. 2022, §4.2.2). Weights start at ones, biases at zeros (layout-independent).

The norm is a node of the layer spec tree (``model.transformer_layer.submodules.input_layernorm`` /
``pre_mlp_layernorm``, kind `NORM`, interface `NormModule`). The default target `Norm` picks the class
from ``model.normalization`` (LayerNorm | RMSNorm, the table `NORMALIZATIONS`), as Megatron-core's
``WrappedTorchNorm``: that key stays the one switch between the built-ins, and a node whose
``_target_`` names another class ignores it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mptrain.components import ComponentKind
from mptrain.errors import ConfigError, check_choice
from mptrain.layers.context import LayerContext
from mptrain.layers.sharding import ShardSpec


class NormModule(Protocol):
    """A normalisation over the last dim h.

    Built as ``target(hidden_size, *, config, eps, context)`` (only the keywords it accepts;
    ``context``: `LayerContext`, whose ``params_dtype`` / ``device`` its parameters take).
    ``forward(x [s(/tp), b, h]) -> [s(/tp), b, h]``, same dtype. Its parameters are replicated over
    TP; under ``context.sequence_parallel`` their grads are partial sums that
    ``finalize_model_grads`` all-reduces over TP when the module's `local_shard_specs` marks them
    ``sequence_parallel_grad`` (a module without `local_shard_specs` gets replicated specs: fine
    without SP, wrong grads with SP). Weights should not depend on the layout.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


NORM = ComponentKind("norm", methods=("forward",),
                     runtime_keywords=("hidden_size", "config", "eps", "context"),
                     interface=NormModule)


def _norm_specs(module: torch.nn.Module, sequence_parallel: bool) -> dict:
    return {
        name: ShardSpec(global_shape=tuple(p.shape), no_weight_decay=True, sequence_parallel_grad=sequence_parallel)
        for name, p in module.named_parameters(recurse=False)
    }


class LayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm over the last dim h; input/output ``[s(/tp), b, h]``; weight and bias ``[h]``."""

    kernel = "torch.nn.functional.layer_norm"
    """What computes the forward (the start-up log's ``kernels:`` line, `describe_norm`)."""

    def __init__(self, hidden_size: int, *, eps: float, context: LayerContext) -> None:
        super().__init__(hidden_size, eps=eps, device=context.device, dtype=context.params_dtype)
        self.sequence_parallel = context.sequence_parallel

    def local_shard_specs(self) -> dict:
        return _norm_specs(self, self.sequence_parallel)


class LayerNorm1P(LayerNorm):
    """``model.apply_layernorm_1p`` (Megatron's zero-centred gamma): the weight w ``[h]`` holds gamma - 1, starts at
    zeros and is applied as (1 + w): y = (x - mean) / sqrt(var + eps) · (1 + w) + b. Equal to `LayerNorm` with weight
    1 + w; weight decay (norm params have none here) or a checkpoint of w would see gamma - 1."""

    kernel = "torch.nn.functional.layer_norm (weight 1 + w)"

    def __init__(self, hidden_size: int, *, eps: float, context: LayerContext) -> None:
        super().__init__(hidden_size, eps=eps, context=context)
        with torch.no_grad():
            self.weight.zero_()  # gamma = 1 + 0 at init: the plain LayerNorm's start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm over the last dim h (Zhang & Sennrich 2019); weight ``[h]``, no bias."""

    kernel = "torch.nn.functional.rms_norm"

    def __init__(self, hidden_size: int, *, eps: float, context: LayerContext) -> None:
        super().__init__(hidden_size, eps=eps, device=context.device, dtype=context.params_dtype)
        self.sequence_parallel = context.sequence_parallel

    def local_shard_specs(self) -> dict:
        return _norm_specs(self, self.sequence_parallel)


class RMSNorm1P(RMSNorm):
    """``model.apply_layernorm_1p`` with RMSNorm (Megatron's zero-centred gamma, as Transformer Engine's RMSNorm
    ``zero_centered_gamma``): the weight w ``[h]`` holds gamma - 1, starts at zeros and is applied as (1 + w):
    y = x / sqrt(mean(x²) + eps) · (1 + w)."""

    kernel = "torch.nn.functional.rms_norm (weight 1 + w)"

    def __init__(self, hidden_size: int, *, eps: float, context: LayerContext) -> None:
        super().__init__(hidden_size, eps=eps, context=context)
        with torch.no_grad():
            self.weight.zero_()  # gamma = 1 + 0 at init: the plain RMSNorm's start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def _apex_norm_functions():
    """apex's fused norm autograd functions (``apex.normalization.fused_layer_norm``).

    Raises:
        ConfigError: apex (with its CUDA extension) is not importable.
    """
    try:
        from apex.normalization import fused_layer_norm as fln  # noqa: PLC0415 - optional dependency
    except ImportError as err:
        raise ConfigError(
            f"model: normalization=ApexFused* needs NVIDIA apex built with its CUDA extension ({err}); build it "
            "(APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install --no-build-isolation ./apex) or use "
            "normalization=LayerNorm / RMSNorm") from None
    return fln


class ApexFusedLayerNorm(LayerNorm):
    """`LayerNorm` (same params, state dict and specs) computed by apex's ``FusedLayerNorm`` kernels
    (Megatron's default when apex is present). CUDA only; same math, rounding differs by ulps."""

    kernel = "apex FusedLayerNorm (fused_layer_norm_affine)"

    def __init__(self, hidden_size: int, **kwargs) -> None:
        super().__init__(hidden_size, **kwargs)
        self._fln = _apex_norm_functions()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fln.fused_layer_norm_affine(x, self.weight, self.bias, self.normalized_shape, self.eps)


class ApexFusedRMSNorm(RMSNorm):
    """`RMSNorm` computed by apex's ``FusedRMSNorm`` kernels (same params, state dict and specs)."""

    kernel = "apex FusedRMSNorm (fused_rms_norm_affine)"

    def __init__(self, hidden_size: int, **kwargs) -> None:
        super().__init__(hidden_size, **kwargs)
        self._fln = _apex_norm_functions()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fln.fused_rms_norm_affine(x, self.weight, self.normalized_shape, self.eps)


NORMALIZATIONS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm, "ApexFusedLayerNorm": ApexFusedLayerNorm,
                  "ApexFusedRMSNorm": ApexFusedRMSNorm}
"""``model.normalization`` -> the built-in class (the one table of that Megatron key)."""

ZERO_CENTERED = {"LayerNorm": LayerNorm1P, "RMSNorm": RMSNorm1P}
"""``model.normalization`` -> its ``model.apply_layernorm_1p`` class (weight = gamma - 1)."""


def check_normalization(model) -> None:
    """``model.normalization`` is a built-in name; ``model.apply_layernorm_1p`` only with LayerNorm or RMSNorm (the
    forms `ZERO_CENTERED` has). Raises ConfigError naming the key and the fix."""
    check_choice("model.normalization", model.normalization, tuple(NORMALIZATIONS))
    if model.apply_layernorm_1p and model.normalization not in ZERO_CENTERED:
        raise ConfigError(f"model.apply_layernorm_1p=true (zero-centred gamma) has no {model.normalization} form; set "
                          f"model.normalization to one of {', '.join(ZERO_CENTERED)} or model.apply_layernorm_1p=false")


def Norm(hidden_size: int, *, config, eps: float, context: LayerContext) -> torch.nn.Module:  # noqa: N802 - a class-like factory (Megatron's WrappedTorchNorm)
    """The default norm node: ``NORMALIZATIONS[config.normalization](hidden_size, eps=eps, context=context)``;
    `ZERO_CENTERED`'s class with ``config.apply_layernorm_1p`` (LayerNorm and RMSNorm: `check_normalization`)."""
    if getattr(config, "apply_layernorm_1p", False):
        return ZERO_CENTERED[config.normalization](hidden_size, eps=eps, context=context)
    return NORMALIZATIONS[config.normalization](hidden_size, eps=eps, context=context)


def describe_norm(module: torch.nn.Module) -> str:
    """``<class dotted path> (<kernel>)`` of a built norm node, for the start-up log; a user class
    without a ``kernel`` attribute is named by its class alone."""
    # a module sharded by FSDP2 has a generated subclass (FSDP<Name>, FSDPModule first): name the norm's own class
    cls = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed.fsdp"))
    kernel = getattr(cls, "kernel", None)
    path = f"{cls.__module__}.{cls.__qualname__}"
    return f"{path} ({kernel})" if kernel else path
