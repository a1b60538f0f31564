"""Mixed precision: loss scalers, `Float16Module`, the fp32 / mixed-precision optimizer wrappers, grad clipping."""

from mptrain.precision.clip_grads import clip_grads_by_total_norm, count_zeros_fp32, get_grad_norm_fp32
from mptrain.precision.module import Float16Module
from mptrain.precision.optimizer import (
    FP32Optimizer,
    MainParamEntry,
    OPTIMIZER_WRAPPER,
    MixedPrecisionOptimizer,
    OptimizerWrapper,
    ParamState,
    StepResult,
    StepStats,
    TooManySkippedStepsError,
    WrapperState,
)
from mptrain.precision.scaler import (
    ConstantLossScaler,
    DynamicLossScaler,
    LossScaler,
    LOSS_SCALER,
    auto_loss_scaler,
    build_loss_scaler,
    check_scaler_for_precision,
    no_loss_scaler,
)

# precision.name -> params dtype: the one table of precision options (a closed Megatron choice, --fp16 / --bf16)
PARAM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def params_dtype(precision: str):
    """torch dtype of model params for ``precision.name`` (fp32 | bf16 | fp16).

    Raises:
        ConfigError: unknown precision name.
    """
    import torch

    from mptrain.errors import ConfigError

    if precision not in PARAM_DTYPES:
        raise ConfigError(f"precision: unknown precision={precision!r}; pick one of {', '.join(PARAM_DTYPES)}")
    return getattr(torch, PARAM_DTYPES[precision])


__all__ = [
    "ConstantLossScaler", "DynamicLossScaler", "LossScaler", "build_loss_scaler",
    "LOSS_SCALER", "auto_loss_scaler", "no_loss_scaler", "check_scaler_for_precision",
    "Float16Module", "FP32Optimizer", "MainParamEntry", "MixedPrecisionOptimizer", "OPTIMIZER_WRAPPER", "OptimizerWrapper",
    "ParamState", "StepResult", "StepStats", "TooManySkippedStepsError", "WrapperState", "clip_grads_by_total_norm", "count_zeros_fp32",
    "get_grad_norm_fp32", "PARAM_DTYPES", "params_dtype",
]
