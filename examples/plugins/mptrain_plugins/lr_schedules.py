"""A user's own LR schedule, written against `mptrain.optim.lr_scheduler.LRScheduler` (no mptrain edit).

Cosine with warm restarts (Loshchilov & Hutter 2017, "SGDR"), after a linear warmup:

    n <= W (W > 0) :  lr * n / W
    otherwise      :  min_lr + (lr - min_lr) * (1 + cos(pi * t / cycle_iters)) / 2,   t = (n - W) mod cycle_iters

Selected from the command line; ``lr``, ``min_lr`` and ``lr_warmup_iters`` come from the Megatron
``optim.*`` keys (passed because the signature takes them), ``cycle_iters`` is this class's own key::

    python train.py optim.lr_scheduler._target_=mptrain_plugins.lr_schedules.CosineWithRestarts \\
        +optim.lr_scheduler.cycle_iters=4
"""

from __future__ import annotations

import math


class CosineWithRestarts:
    """Args:
        optimizer: anything with ``param_groups`` (the trainer passes its optimizer wrapper).
        lr, min_lr: peak and floor LR (optim.lr, optim.min_lr).
        lr_warmup_iters: warmup steps (optim.lr_warmup_iters).
        cycle_iters: length of one cosine cycle in applied steps (>= 1).
    """

    def __init__(self, optimizer, *, lr: float, min_lr: float, lr_warmup_iters: int, cycle_iters: int) -> None:
        if int(cycle_iters) < 1:
            raise ValueError(f"cycle_iters={cycle_iters} must be >= 1")
        self.optimizer = optimizer
        self.lr, self.min_lr = float(lr), float(min_lr)
        self.lr_warmup_iters, self.cycle_iters = int(lr_warmup_iters), int(cycle_iters)
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        n, w = self.num_steps, self.lr_warmup_iters
        if w > 0 and n <= w:
            return self.lr * n / w
        t = (n - w) % self.cycle_iters
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t / self.cycle_iters))

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` applied optimizer steps (the trainer skips it on skipped steps)."""
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.num_steps = int(state_dict["num_steps"])
        self.step(0)
