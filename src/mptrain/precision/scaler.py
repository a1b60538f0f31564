"""The loss scaler component: `LossScaler` (interface), constant and dynamic scalers, `build_loss_scaler`.

Selected by ``loss_scaler._target_`` (dynamic: `DynamicLossScaler`, constant: `ConstantLossScaler`,
none: `no_loss_scaler`, auto: `auto_loss_scaler`, which picks dynamic when the params are float16
and none otherwise: DESIGN.md's auto, decided on the params dtype, not on a name).

fp16 has a 5-bit exponent: gradients below ~6e-8 flush to zero. Multiplying the loss by a scale S
before backward shifts every gradient up by S; the optimizer multiplies the fp32 main grads by
1/S (`inv_scale`) before clipping and stepping. A too-large S overflows to inf/nan: that step is
skipped and a dynamic scaler lowers S (Micikevicius et al., "Mixed Precision Training", 2018, §3.2).

Megatron names: `ConstantGradScaler`, `DynamicGradScaler` (megatron/core/optimizer/grad_scaler.py).
The dynamic scaler's state machine follows Megatron's *code* (megatron/core/optimizer/grad_scaler.py), not the
prose of some write-ups:

- overflow: growth tracker := 0; hysteresis tracker -= 1; if the hysteresis tracker is <= 0 the
  scale backs off: S := max(S * backoff_factor, min_scale). The hysteresis tracker is NOT reset by
  the backoff nor by clean steps, so once exhausted every further overflow backs off again.
- clean step: growth tracker += 1; when it reaches growth_interval: growth tracker := 0,
  hysteresis tracker := hysteresis (the only reset), S := S * growth_factor.

The step is skipped on every overflow, whether or not the scale backs off (the optimizer does
that, not the scaler).

Scales are kept in float32 [1]-tensors on the CPU (`scale`, `inv_scale`); the optimizer moves them
to the grads' device. Powers of two (the defaults) are exact in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mptrain import components
from mptrain.components import ComponentKind
from mptrain.config.precision import LossScalerConfig
from mptrain.errors import ConfigError
from mptrain.precision.dtypes import params_dtype


class LossScaler:
    """The loss scaler interface (base class): a scale S (float32 [1] tensor) and its update rule.

    A user scaler (``loss_scaler._target_=my_pkg.MyScaler``) provides ``scale`` and ``inv_scale``
    (float32 tensors of shape [1], CPU; the optimizer moves them to the grads' device), ``dynamic``
    (bool), ``update(found_inf: bool)`` (called once per iteration, skipped ones included, with the
    all-reduced verdict), ``state_dict()`` / ``load_state_dict()`` (saved in every checkpoint).

    Attributes:
        dynamic: whether `update` changes the scale (a skipped step is then expected, not a NaN).
    """

    dynamic: bool = False

    def __init__(self, scale: float) -> None:
        self._scale = torch.tensor([float(scale)], dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale S, float32 tensor of shape [1] (CPU)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / S as a float32 [1] tensor (what `_amp_foreach_non_finite_check_and_unscale_` multiplies by)."""
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """Advance the scaler after a step; ``found_inf``: any grad was inf/nan on any rank."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"scale": float(self._scale.item())}

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = torch.tensor([float(state_dict["scale"])], dtype=torch.float32)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self._scale.item():g})"


class ConstantLossScaler(LossScaler):
    """A fixed scale (Megatron `ConstantGradScaler`); overflowing steps are still skipped by the optimizer.

    Raises:
        ConfigError: scale <= 0.
    """

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ConfigError(f"loss_scaler: scale={scale} must be > 0; set loss_scaler.scale=4096 (a power of two)")
        super().__init__(scale)

    def update(self, found_inf: bool) -> None:
        """Nothing to update: the scale is constant."""


class DynamicLossScaler(LossScaler):
    """Megatron's `DynamicGradScaler`: back off after `hysteresis` overflows, grow after `growth_interval` clean steps.

    Args:
        initial_scale: starting S (Megatron default 2^32).
        min_scale: floor of the backoff (default 1.0).
        growth_factor: S *= this after growth_interval consecutive clean steps (> 1; default 2).
        backoff_factor: S *= this on an overflow once hysteresis is exhausted (0 < f < 1; default 0.5).
        growth_interval: clean steps (consecutive: an overflow resets the count) before growth (default 1000).
        hysteresis: overflows tolerated since the last growth before the first backoff (default 2).
    Raises:
        ConfigError: a value outside the ranges above (names the `loss_scaler.` key).
    """

    dynamic = True

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ) -> None:
        checks = (
            (initial_scale > 0, f"loss_scaler: initial_scale={initial_scale} must be > 0"),
            (min_scale > 0, f"loss_scaler: min_scale={min_scale} must be > 0"),
            (min_scale <= initial_scale, f"loss_scaler: min_scale={min_scale} must be <= initial_scale={initial_scale}"),
            (growth_factor > 1.0, f"loss_scaler: growth_factor={growth_factor} must be > 1"),
            (0.0 < backoff_factor < 1.0, f"loss_scaler: backoff_factor={backoff_factor} must be in (0, 1)"),
            (growth_interval > 0, f"loss_scaler: growth_interval={growth_interval} must be >= 1"),
            (hysteresis > 0, f"loss_scaler: hysteresis={hysteresis} must be >= 1"),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message + " (defaults: initial_scale=2^32, min_scale=1, growth_factor=2, "
                                  "backoff_factor=0.5, growth_interval=1000, hysteresis=2)")
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last overflow or growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before a backoff (<= 0: every overflow backs off until the next growth)."""
        return self._hysteresis_tracker

    def update(self, found_inf: bool) -> None:
        """Megatron `DynamicGradScaler.update` (see the module docstring for the state machine)."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis  # the only place the hysteresis tracker resets
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": float(self._scale.item()),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def auto_loss_scaler(*, params_dtype, initial_scale: float, min_scale: float, growth_factor: float,
                     backoff_factor: float, growth_interval: int, hysteresis: int) -> Optional[LossScaler]:
    """``loss_scaler=auto`` (DESIGN.md §1): a `DynamicLossScaler` when the params are float16, none otherwise.

    The choice is made on the params dtype the runtime passes (``params_dtype``, a torch.dtype), not
    on an option name: float16's 5-bit exponent flushes small grads to zero, bfloat16 / float32
    have float32's exponent range and need no scaling.
    """
    if params_dtype != torch.float16:
        return None
    return DynamicLossScaler(initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis)


def no_loss_scaler() -> None:
    """``loss_scaler=none``: no loss scaling (the factory returns None)."""
    return None


LOSS_SCALER = ComponentKind("loss scaler", methods=("update", "state_dict", "load_state_dict"),
                            interface=LossScaler)

# keys of LossScalerConfig that belong to the wrapper or are labels: never passed to a scaler
_NOT_SCALER_KEYS = ("name", "max_consecutive_skips")


def scaler_label(scaler: Optional[LossScaler]) -> str:
    """none | dynamic | constant: what scaling runs (`DerivedLayout.loss_scaler`), from the built object."""
    return "none" if scaler is None else ("dynamic" if scaler.dynamic else "constant")


def build_loss_scaler(cfg, precision: str) -> Optional[LossScaler]:
    """Build ``loss_scaler._target_`` for ``precision`` (fp32 | bf16 | fp16), the one place it is built,
    and apply the precision rules (`check_scaler_for_precision`).

    Keywords: the `LossScalerConfig` keys the target's signature takes (``initial_scale`` ...,
    ``scale``) and ``params_dtype`` (torch.dtype) if it takes it; keys a user added with ``+`` as they are.
    Returns:
        a `LossScaler`, or None when no loss scaling is used (auto with bf16/fp32, or none).
    Raises:
        ConfigError: unknown precision; the component checks; the scalers' constructors; rejected pairs.
    """
    dtype = params_dtype(precision)
    target = getattr(cfg, "_target_", None)
    extras = components.extra_keys(cfg)
    node = {"_target_": target, **extras}
    # the schema's keys (its defaults under what cfg sets: a partial namespace gets the defaults too)
    defaults = {f.name: f.default for f in dataclasses.fields(LossScalerConfig)}
    values = {**defaults, **vars(cfg)}
    fields = {k: v for k, v in values.items()
              if k not in components.RESERVED_KEYS and k not in _NOT_SCALER_KEYS and k not in extras}
    check_scaler_keys_apply(cfg, fields, defaults)
    scaler = components.build("loss_scaler", node, LOSS_SCALER, mapped={**fields, "params_dtype": dtype})
    check_scaler_for_precision(scaler, precision, scaler_option(cfg))
    return scaler


def check_scaler_keys_apply(cfg, fields: dict, defaults: dict) -> None:
    """A schema key set away from its default that ``loss_scaler._target_`` does not take would be dropped
    silently (`LossScalerConfig` is one schema for every scaler: ``scale`` is constant's, ``initial_scale``
    ... dynamic's and auto's), so it is refused, as the ``precision.fp8_*`` keys are on other precisions.

    Args:
        fields: the scaler keys `build_loss_scaler` maps; defaults: `LossScalerConfig`'s default of each.
    Raises:
        ConfigError: ``loss_scaler.<key>=<value>`` and the scaler that does not use it.
    """
    accepted = components.accepted_keywords(components.import_target("loss_scaler", getattr(cfg, "_target_", None)))
    if accepted is None:  # a target taking **kwargs receives every key
        return
    for key, value in fields.items():
        if key not in accepted and key in defaults and value != defaults[key]:
            raise ConfigError(f"loss_scaler.{key}={value} is not used by loss_scaler={scaler_option(cfg)}; drop the "
                              f"key, or pick the scaler that takes it (dynamic: initial_scale, min_scale, "
                              "growth_factor, backoff_factor, growth_interval, hysteresis; constant: scale)")


def scaler_option(cfg) -> str:
    """How messages name the configured scaler: ``loss_scaler=<label> (_target_=<dotted path>)``'s
    right-hand side; the label (``loss_scaler.name``) alone says nothing once ``_target_`` is overridden."""
    name, target = getattr(cfg, "name", None), getattr(cfg, "_target_", None)
    target = target if isinstance(target, str) or target is None else f"{target.__module__}.{target.__qualname__}"
    return f"{name} (_target_={target})" if name is not None else f"(_target_={target})"


def check_scaler_for_precision(scaler: Optional[LossScaler], precision: str, label: str) -> None:
    """The precision rules of loss scaling, once: fp16 needs a scaler (grads underflow), a dynamic one
    is for fp16 only (bf16/fp32 have fp32's exponent range: nothing to adapt; use constant).

    Raises:
        ConfigError: naming `loss_scaler` and `precision`.
    """
    half = params_dtype(precision) == torch.float16
    if half and scaler is None:
        raise ConfigError(
            f"loss_scaler: precision={precision} with loss_scaler={label} would underflow small fp16 gradients to zero; "
            "use loss_scaler=auto (dynamic) or loss_scaler=dynamic or loss_scaler=constant"
        )
    if not half and scaler is not None and scaler.dynamic:
        raise ConfigError(
            f"loss_scaler: loss_scaler={label} is for precision=fp16 (a dynamic scale; got precision={precision}, whose "
            "exponent range never needs a dynamic scale); use loss_scaler=auto (none) or loss_scaler=constant"
        )
