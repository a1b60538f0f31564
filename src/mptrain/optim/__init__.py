"""Optimizer builders (param groups, torch fused/foreach or apex kernels) and LR schedules."""

from mptrain.optim.builders import OPTIMIZERS, build_optimizer_factory, param_groups
from mptrain.optim.lr_scheduler import LR_DECAY_STYLES, OptimizerParamScheduler

__all__ = ["OPTIMIZERS", "build_optimizer_factory", "param_groups", "LR_DECAY_STYLES", "OptimizerParamScheduler"]
