"""The optimizer component: built from ``optim._target_`` with the param groups the runtime passes.

The optimizer wrappers (`mptrain.precision.optimizer`) own the fp32 main params; they call the
factory returned by `build_optimizer_factory` with the param groups of those main params. The
factory builds ``optim._target_`` through `mptrain.components.build`:

- keywords: the Megatron keys mapped onto the target's keywords where its signature takes them
  (``lr``, ``weight_decay``, ``betas`` = (adam_beta1, adam_beta2), ``eps`` = adam_eps,
  ``momentum`` = sgd_momentum), plus the keys a user added (``+optim.alpha=0.95`` for
  torch.optim.RMSprop), which win;
- kernel (``optim.impl``): ``auto`` / ``torch``: ``fused=True`` (torch's fused kernels, CUDA and CPU,
  where the tests run the same folded step as the GPU: `mptrain.precision.optimizer`) when every
  param is on one CUDA or CPU device type and the target takes ``fused``, else ``foreach=True``
  (multi-tensor) if it takes that; ``apex``: apex ``FusedAdam`` / ``FusedSGD`` for the built-in
  Adam / AdamW / SGD when apex is importable, else a ConfigError.

Weight decay (Megatron `get_param_groups`): biases and norm params (``ShardSpec.no_weight_decay``)
go into a group with weight_decay 0; the other group takes ``optim.weight_decay`` (as the
optimizer default, so that `param_groups` needs no config). ``adam`` is torch's Adam (L2 penalty
added to the grad); ``adamw`` decouples the decay (Loshchilov & Hutter 2019) — Megatron's
``--optimizer adam`` is the decoupled one, i.e. our ``adamw``.

`check_optimizer` (called by `validate_config`) is the start-up check: value ranges, ``impl``, the
component checks, and a throwaway instance on a 1-element tensor (an optimizer rejecting its
arguments is one ConfigError line before any collective).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from mptrain import components
from mptrain.errors import ConfigError

logger = logging.getLogger(__name__)

IMPLS = ("auto", "torch", "apex")


@runtime_checkable
class Optimizer(Protocol):
    """The inner optimizer interface (torch.optim.Optimizer's): what the wrappers and checkpoints use.

    - constructor: ``cls(params, **keywords)``; ``params`` = [{"params": [fp32 main params],
      ("weight_decay": float)}, ...] (a decayed and a no-decay group, always both);
    - ``param_groups``: those dicts; the LR schedule writes ``group["lr"]`` (a float, per step) there;
    - ``step()`` updates the params from their ``.grad`` (fp32, already unscaled and clipped);
    - ``state``: {param: {name: tensor | scalar}}: tensors of the param's shape are checkpointed by
      global offsets (resharded with the param), anything else as an object;
    - ``zero_grad()``, ``state_dict()``, ``load_state_dict(sd)`` as torch.
    """

    param_groups: list

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


OPTIMIZER = components.ComponentKind(
    "optimizer", methods=("step", "zero_grad", "state_dict", "load_state_dict"), runtime_keywords=("params",),
    interface=Optimizer)

_BUILTIN = dataclasses.replace(OPTIMIZER, methods=())


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


def megatron_keywords(cfg) -> dict:
    """Every keyword the Megatron-named `optim` keys map to; each reaches a target only if it takes it."""
    return {**_adam_kwargs(cfg), **_sgd_kwargs(cfg)}


def _apex_fused_adam(adam_w_mode: bool):
    def build(groups, kwargs):
        from apex.optimizers import FusedAdam  # noqa: PLC0415 - optional dependency

        return FusedAdam(groups, adam_w_mode=adam_w_mode, **kwargs)

    return build


def _apex_fused_sgd(groups, kwargs):
    from apex.optimizers import FusedSGD  # noqa: PLC0415 - optional dependency

    return FusedSGD(groups, **kwargs)


# The built-in optimizers, the one table of them: option label -> (torch class, its Megatron keys,
# its apex kernel). Used for optim.impl=apex (a target that is one of these classes) and for
# Python-made configs without a _target_ (OptimConfig(name="sgd")); the shipped conf/optim/*.yaml set
# `_target_` to these classes (tests/test_optim_components.py checks they agree).
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


def check_optimizer_values(cfg) -> None:
    """Value ranges of the Megatron optimizer keys and ``optim.impl``; pure.

    Raises:
        ConfigError: one line per rule, naming the key and the fix.
    """
    if cfg.impl not in IMPLS:
        raise ConfigError(f"optim: unknown optim.impl={cfg.impl!r}; pick one of {', '.join(IMPLS)}")
    rules = (
        (cfg.lr >= 0, f"optim.lr={cfg.lr} must be >= 0; set optim.lr to the peak learning rate, e.g. 3e-4"),
        (cfg.min_lr <= cfg.lr, f"optim.min_lr={cfg.min_lr} must be <= optim.lr={cfg.lr}; lower optim.min_lr"),
        (cfg.weight_decay >= 0, f"optim.weight_decay={cfg.weight_decay} must be >= 0; use 0 for none"),
        (0 <= cfg.adam_beta1 < 1, f"optim.adam_beta1={cfg.adam_beta1} must be in [0, 1); e.g. 0.9"),
        (0 <= cfg.adam_beta2 < 1, f"optim.adam_beta2={cfg.adam_beta2} must be in [0, 1); e.g. 0.999 or 0.95"),
        (cfg.adam_eps > 0, f"optim.adam_eps={cfg.adam_eps} must be > 0; e.g. 1e-8"),
    )
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def optimizer_node(cfg) -> tuple[dict, Optional[tuple]]:
    """The component node of ``cfg`` (``_target_`` + the user's own keys) and its built-in row, if any.

    Raises:
        ConfigError: no ``_target_`` and an unknown ``optim.name``.
    """
    target = getattr(cfg, "_target_", None)
    if target is None:
        if cfg.name not in OPTIMIZERS:
            raise ConfigError(f"optim: unknown optimizer optim.name={cfg.name!r}; pick one of {', '.join(OPTIMIZERS)} "
                              "or set optim._target_ to an optimizer class")
        row = OPTIMIZERS[cfg.name]
        return {"_target_": row[0], **components.extra_keys(cfg)}, row
    obj = components.import_target("optim", target)
    row = next((r for r in OPTIMIZERS.values() if r[0] is obj), None)
    return {"_target_": target, **components.extra_keys(cfg)}, row


def build_optimizer_factory(cfg) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A function ``param_groups -> optimizer`` for the `OptimConfig` ``cfg`` (see the module docstring).

    Raises (at once, not when the factory is called):
        ConfigError: `check_optimizer_values`; a ``_target_`` that does not import or lacks a method;
            ``impl=apex`` for a user target or without apex installed. Keyword errors of the target
            are raised when the factory is called (`check_optimizer` calls it at start-up).
    """
    check_optimizer_values(cfg)
    node, row = optimizer_node(cfg)
    # the interface is checked on config-selected targets; the table's rows are torch's own classes
    kind = OPTIMIZER if row is None or getattr(cfg, "_target_", None) is not None else _BUILTIN
    components.resolve("optim", node, kind)  # import + interface now
    impl = cfg.impl
    if impl == "apex":
        if row is None:
            raise ConfigError(f"optim.impl=apex: apex kernels exist only for the built-in {', '.join(OPTIMIZERS)} "
                              f"optimizers, not optim._target_={cfg._target_}; use optim.impl=auto")
        if not _apex_available():
            raise ConfigError(
                "optim: optim.impl=apex but apex.optimizers is not importable; install NVIDIA apex from source "
                "or use optim.impl=auto (torch fused/foreach kernels)"
            )
    mapped = row[1](cfg) if row is not None else megatron_keywords(cfg)

    def build(groups: list[dict]):
        if impl == "apex":
            logger.info("optimizer: %s via apex fused kernels", cfg.name)
            return row[2](groups, dict(mapped))
        _, accepted_kw = components.resolve("optim", node, kind, mapped={"fused": True})
        fused = _fused_kernel_available(groups) and (row is not None or "fused" in accepted_kw)
        kernel = {"fused": True} if fused else {"foreach": True}
        if kind is _BUILTIN:  # a table row (Python-made config): the class's first positional is the groups
            _, kwargs = components.resolve("optim", node, kind, mapped={**mapped, **kernel})
            opt = node["_target_"](groups, **kwargs)
        else:
            opt = components.build("optim", node, kind, runtime={"params": groups}, mapped={**mapped, **kernel})
        logger.info("optimizer: %s (%s)", type(opt).__name__, next(iter(kernel)))
        return opt

    return build


def check_optimizer(cfg):
    """Start-up check of ``optim`` (pure: config only, no collectives, no files): values, the
    component checks and a throwaway instance on a 1-element tensor, which it returns (the LR
    schedule's start-up check builds on it).

    Raises:
        ConfigError: one line naming the key, the dotted path and the fix.
    """
    return build_optimizer_factory(cfg)([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
