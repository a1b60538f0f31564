"""Schemas of the `precision` and `loss_scaler` config groups (DESIGN.md §1 "Components").

``precision._target_`` is the optimizer wrapper (FP32Optimizer / MixedPrecisionOptimizer; the rule
for ``parallel.use_distributed_optimizer`` is `mptrain.distributed.distrib_optimizer.wrapper_target`);
``loss_scaler._target_`` the loss scaler (`mptrain.precision.scaler.build_loss_scaler`; auto is the
function `mptrain.precision.scaler.auto_loss_scaler`, which decides on the params dtype).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PrecisionConfig:
    _target_: str = "mptrain.precision.optimizer.FP32Optimizer"
    """The optimizer wrapper class (`mptrain.precision.optimizer.OptimizerWrapper` interface): FP32Optimizer
    for fp32, MixedPrecisionOptimizer for bf16 / fp16. With parallel.use_distributed_optimizer=true a
    built-in wrapper is replaced by mptrain.distributed.DistributedOptimizer (`wrapper_target`)."""
    _partial_: bool = True
    """The runtime passes the inner optimizer factory, the params (or model chunks), groups and scaler."""
    name: str = "fp32"
    """fp32 | bf16 | fp16 | fp8: the dtype of model params and activations (main params stay fp32;
    `mptrain.precision.PARAM_DTYPES`); fp8 = bf16 params and activations with the transformer layers'
    GEMMs (QKV, proj, fc1, fc2) in FP8 (`mptrain.layers.fp8`)."""
    allow_tf32: bool = False
    """fp32 only: let CUDA matmuls / convolutions use TF32 tensor cores."""
    fp8_recipe: str = "tensorwise"
    """fp8 only: the scaling recipe (torchao's names): tensorwise (one dynamic scale per tensor) | rowwise
    (one per row, power-of-2 scales) | rowwise_with_gw_hp (rowwise, the weight-grad GEMM in bf16)."""
    fp8_emulate: bool = False
    """fp8 only: torchao's emulation (the same scaling and rounding, GEMMs in fp32); needed on CPU, for tests."""
    fp8_first_last_layers_bf16: int = 0
    """fp8 only: the first N and the last N transformer layers stay bf16 (Megatron's --first-last-layers-bf16); 0 = none."""
    fp8_gemm_filter: str = "auto"
    """fp8 only: auto (GEMMs too small to gain stay bf16: torchao's size thresholds, on the global weight shape)
    | none (every block GEMM whose local dims are multiples of 16)."""


@dataclasses.dataclass
class LossScalerConfig:
    """One schema for every option; `_target_` picks the scaler. Each key reaches the target only if
    its signature takes it (the dynamic keys go to DynamicLossScaler, `scale` to ConstantLossScaler)."""

    _target_: str = "mptrain.precision.scaler.auto_loss_scaler"
    """The scaler class or factory (`mptrain.precision.scaler.LossScaler` interface; a factory may return
    None = no loss scaling); conf/loss_scaler/*.yaml set it, the default is auto.yaml's (dynamic for fp16,
    none otherwise). fp16 without a scaler is rejected; a dynamic scaler needs fp16."""
    name: str = "auto"
    """The option's label (auto | dynamic | constant | none for the shipped files), for messages only: `_target_` selects."""
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
    """End the run with an error after more than this many skipped steps in a row (0 = never); read by the wrapper."""
