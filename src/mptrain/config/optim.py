"""Schema of the `optim` config group: optimizer and LR schedule (DESIGN.md §1).

Built by `mptrain.optim.build_optimizer_factory(cfg)` and `mptrain.optim.OptimizerParamScheduler`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class OptimConfig:
    name: str = "adam"
    """adam | adamw | sgd (torch.optim.Adam / AdamW / SGD)."""
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (<= lr)."""
    weight_decay: float = 0.0
    """Applied to weights only: biases and norm params are in a no-decay group."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0 (iteration 1 runs at lr 0 when > 0, as Megatron)."""
    lr_decay_iters: Optional[int] = None
    """Iteration at which the decay reaches min_lr (warmup included); null: no decay (style must be constant)."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine. Skipped (overflow / non-finite) iterations do not advance the schedule (Megatron)."""
    impl: str = "auto"
    """auto | torch | apex: apex FusedAdam/FusedSGD when asked for (error if not importable); torch fused (CUDA or CPU) otherwise (foreach for params on other or mixed devices)."""
