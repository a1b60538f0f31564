"""The optimizer and LR schedule components (built from ``optim._target_`` / ``optim.lr_scheduler._target_``)."""

from mptrain.optim.builders import (
    OPTIMIZER,
    APEX_KERNELS,
    EMBEDDING_OR_OUTPUT,
    Optimizer,
    build_optimizer_factory,
    check_optimizer,
    optimizer_kernel,
    param_groups,
    weight_decay_coupling,
    weight_decay_note,
)
from mptrain.optim.lr_scheduler import (
    LR_DECAY_STYLES,
    LR_SCHEDULER,
    LR_WSD_DECAY_STYLES,
    LRScheduler,
    OptimizerParamScheduler,
    build_lr_scheduler,
    check_lr_scheduler,
)

__all__ = ["OPTIMIZER", "APEX_KERNELS", "EMBEDDING_OR_OUTPUT", "Optimizer", "build_optimizer_factory", "check_optimizer", "optimizer_kernel", "param_groups",
           "weight_decay_coupling", "weight_decay_note",
           "LR_DECAY_STYLES", "LR_SCHEDULER", "LR_WSD_DECAY_STYLES", "LRScheduler", "OptimizerParamScheduler",
           "build_lr_scheduler", "check_lr_scheduler"]
