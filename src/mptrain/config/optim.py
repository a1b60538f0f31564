"""Schema of the `optim` config group: optimizer and LR schedule (DESIGN.md §1)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class OptimConfig:
    name: str = "adam"
    """adam | adamw | sgd."""
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    """Applied to weights only: biases and norm params are in a no-decay group."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    """null: no decay (constant after warmup)."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine."""
    impl: str = "auto"
    """auto | torch | apex: apex FusedAdam when importable and asked for; torch fused/foreach otherwise."""
