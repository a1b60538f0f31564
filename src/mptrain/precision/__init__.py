"""Mixed precision: loss scalers, `Float16Module`, the fp32 / mixed-precision optimizer wrappers, grad clipping."""

from mptrain.precision.clip_grads import clip_grads_by_total_norm, count_zeros_fp32, get_grad_norm_fp32
from mptrain.precision.dtypes import PARAM_DTYPES, params_dtype
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

__all__ = [
    "ConstantLossScaler", "DynamicLossScaler", "LossScaler", "build_loss_scaler",
    "LOSS_SCALER", "auto_loss_scaler", "no_loss_scaler", "check_scaler_for_precision",
    "Float16Module", "FP32Optimizer", "MainParamEntry", "MixedPrecisionOptimizer", "OPTIMIZER_WRAPPER", "OptimizerWrapper",
    "ParamState", "StepResult", "StepStats", "TooManySkippedStepsError", "WrapperState", "clip_grads_by_total_norm", "count_zeros_fp32",
    "get_grad_norm_fp32", "PARAM_DTYPES", "params_dtype",
]
