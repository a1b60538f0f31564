"""Schemas of the `precision` and `loss_scaler` config groups (DESIGN.md §1).

Built by `mptrain.precision.params_dtype(name)` and `mptrain.precision.build_loss_scaler(cfg, precision)`;
the pair check (fp16 needs a scaler, dynamic needs fp16) is `mptrain.precision.resolve_loss_scaler_name`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PrecisionConfig:
    name: str = "fp32"
    """fp32 | bf16 | fp16: the dtype of model params and activations (main params stay fp32)."""
    allow_tf32: bool = False
    """fp32 only: let CUDA matmuls / convolutions use TF32 tensor cores."""


@dataclasses.dataclass
class LossScalerConfig:
    """One schema for every option; `name` picks the scaler (auto: dynamic for fp16, none otherwise)."""

    name: str = "auto"
    """auto | dynamic | constant | none. fp16 + none is rejected; dynamic needs fp16."""
    initial_scale: float = 2.0**32
    """dynamic: starting loss scale S (a power of two)."""
    min_scale: float = 1.0
    """dynamic: floor of the backoff (> 0, <= initial_scale)."""
    growth_factor: float = 2.0
    """dynamic: S *= growth_factor after growth_interval consecutive clean steps (> 1)."""
    backoff_factor: float = 0.5
    """dynamic: S *= backoff_factor on an overflow once hysteresis is exhausted (in (0, 1))."""
    growth_interval: int = 1000
    """dynamic: consecutive clean steps (iterations) before the scale grows (>= 1)."""
    hysteresis: int = 2
    """dynamic: overflows tolerated since the last growth before a backoff (>= 1; reset only on growth)."""
    scale: float = 4096.0
    """constant: the fixed scale (> 0)."""
    max_consecutive_skips: int = 100
    """End the run with an error after more than this many skipped steps in a row (0 = never)."""
