"""Build the inner optimizer (Adam / AdamW / SGD) from the `optim` config.

The optimizer wrappers (`mptrain.precision.optimizer`) own the fp32 main params; they call the
factory returned by `build_optimizer_factory` with the param groups of those main params. The
factory picks the kernel:

- ``impl=auto`` or ``torch``: torch's ``fused=True`` kernels (CUDA, and CPU, where the tests run
  the same folded step as the GPU: `mptrain.precision.optimizer`); ``foreach=True`` (multi-tensor,
  horizontally fused) for params on any other device or on mixed devices;
- ``impl=apex``: apex ``FusedAdam`` / ``FusedSGD`` when apex is importable, else a ConfigError.

Weight decay (Megatron `get_param_groups`): biases and norm params (``ShardSpec.no_weight_decay``)
go into a group with weight_decay 0; the other group takes ``optim.weight_decay`` (as the
optimizer default, so that `param_groups` needs no config). ``adam`` is torch's Adam (L2 penalty
added to the grad); ``adamw`` decouples the decay (Loshchilov & Hutter 2019) — Megatron's
``--optimizer adam`` is the decoupled one, i.e. our ``adamw``.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from mptrain.errors import ConfigError

logger = logging.getLogger(__name__)

IMPLS = ("auto", "torch", "apex")


def param_groups(params: Sequence[torch.nn.Parameter], specs: Sequence, weight_decay: Optional[float] = None) -> list[dict]:
    """Split params into a decayed and a non-decayed group (always both, possibly empty, in that order).

    Args:
        params: parameters (model or fp32 main params), in a stable order.
        specs: one `ShardSpec` per param; ``spec.no_weight_decay`` selects the second group.
        weight_decay: decay of the first group; None leaves the key out, so the optimizer default
            (``optim.weight_decay`` from `build_optimizer_factory`) applies.
    Returns:
        [{"params": decayed, ["weight_decay": wd]}, {"params": not_decayed, "weight_decay": 0.0}]
    Raises:
        ValueError: params and specs differ in length.
    """
    if len(params) != len(specs):
        raise ValueError(f"param_groups: {len(params)} params but {len(specs)} specs")
    decay = [p for p, s in zip(params, specs) if not s.no_weight_decay]
    no_decay = [p for p, s in zip(params, specs) if s.no_weight_decay]
    first: dict = {"params": decay}
    if weight_decay is not None:
        first["weight_decay"] = float(weight_decay)
    return [first, {"params": no_decay, "weight_decay": 0.0}]


def _adam_kwargs(cfg) -> dict:
    return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay}


def _sgd_kwargs(cfg) -> dict:
    return {"lr": cfg.lr, "momentum": cfg.sgd_momentum, "weight_decay": cfg.weight_decay}


def _apex_fused_adam(adam_w_mode: bool):
    def build(groups, kwargs):
        from apex.optimizers import FusedAdam  # noqa: PLC0415 - optional dependency

        return FusedAdam(groups, adam_w_mode=adam_w_mode, **kwargs)

    return build


def _apex_fused_sgd(groups, kwargs):
    from apex.optimizers import FusedSGD  # noqa: PLC0415 - optional dependency

    return FusedSGD(groups, **kwargs)


# name -> (torch class, config -> kwargs, apex builder(groups, kwargs))
OPTIMIZERS: dict[str, tuple] = {
    "adam": (torch.optim.Adam, _adam_kwargs, _apex_fused_adam(False)),
    "adamw": (torch.optim.AdamW, _adam_kwargs, _apex_fused_adam(True)),
    "sgd": (torch.optim.SGD, _sgd_kwargs, _apex_fused_sgd),
}


def _apex_available() -> bool:
    try:
        import apex.optimizers  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _fused_kernel_available(groups: list[dict]) -> bool:
    """Every param on one CUDA or CPU device type (torch's fused Adam / AdamW / SGD kernels)."""
    types = {p.device.type for g in groups for p in g["params"]}
    return types in ({"cuda"}, {"cpu"})


def build_optimizer_factory(cfg) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A function ``param_groups -> torch.optim.Optimizer`` for the `OptimConfig` ``cfg``.

    Raises (at once, not when the factory is called):
        ConfigError: unknown ``optim.name`` or ``optim.impl``; ``impl=apex`` without apex installed;
            lr < 0, min_lr > lr or weight_decay < 0.
    """
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim: unknown optimizer optim.name={cfg.name!r}; pick one of {', '.join(OPTIMIZERS)}")
    if cfg.impl not in IMPLS:
        raise ConfigError(f"optim: unknown optim.impl={cfg.impl!r}; pick one of {', '.join(IMPLS)}")
    if cfg.impl == "apex" and not _apex_available():
        raise ConfigError(
            "optim: optim.impl=apex but apex.optimizers is not importable; install NVIDIA apex from source "
            "or use optim.impl=auto (torch fused/foreach kernels)"
        )
    if cfg.lr < 0 or cfg.weight_decay < 0 or cfg.min_lr > cfg.lr:
        raise ConfigError(
            f"optim: need 0 <= optim.min_lr <= optim.lr and optim.weight_decay >= 0 "
            f"(got lr={cfg.lr}, min_lr={cfg.min_lr}, weight_decay={cfg.weight_decay})"
        )
    torch_cls, kwargs_of, apex_build = OPTIMIZERS[cfg.name]
    kwargs = kwargs_of(cfg)
    impl = cfg.impl

    def build(groups: list[dict]) -> torch.optim.Optimizer:
        if impl == "apex":
            logger.info("optimizer: %s via apex fused kernels", cfg.name)
            return apex_build(groups, dict(kwargs))
        kernel = {"fused": True} if _fused_kernel_available(groups) else {"foreach": True}
        logger.info("optimizer: %s via torch.optim.%s(%s)", cfg.name, torch_cls.__name__, next(iter(kernel)))
        return torch_cls(groups, **kwargs, **kernel)

    return build
