"""Schemas of the `precision` and `loss_scaler` config groups (DESIGN.md §1)."""

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
    """auto | dynamic | constant | none."""
    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    """Clean steps before the scale grows."""
    hysteresis: int = 2
    """Overflows tolerated (since the last growth) before a backoff."""
    scale: float = 4096.0
    """constant: the fixed scale."""
    max_consecutive_skips: int = 100
    """End the run with an error after this many skipped steps in a row."""
