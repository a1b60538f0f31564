"""Learning-rate schedule: linear warmup from 0, then constant / linear / cosine decay to min_lr.

Megatron `OptimizerParamScheduler` (megatron/core/optimizer_param_scheduler.py), counted in
iterations (``step(increment=1)`` after every optimizer step). With ``n`` = steps taken so far,
W = lr_warmup_iters, D = lr_decay_iters, the LR used for the next optimizer step is

    n <= W and W > 0 :  lr * n / W                      (warmup; iteration 1 runs at lr 0, as Megatron)
    style constant   :  lr
    n > D            :  min_lr
    otherwise        :  min_lr + c(r) * (lr - min_lr),  r = (n - W) / (D - W)
                        linear c = 1 - r;   cosine c = (1 + cos(pi r)) / 2  (Loshchilov & Hutter 2017)

Skipped steps (fp16 overflow, non-finite grads): the iteration counter advances (a skipped
iteration counts toward ``train_iters``), the LR schedule does not — the training loop calls
`step` only after an applied update (Megatron's ``train_step``: ``if update_successful:
opt_param_scheduler.step(...)``). A run of ``train_iters`` iterations therefore applies at most
``train_iters`` updates, and the schedule position equals the number of applied updates.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from mptrain.errors import ConfigError

logger = logging.getLogger(__name__)


def _linear(ratio: float) -> float:
    return 1.0 - ratio


def _cosine(ratio: float) -> float:
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


# style -> decay coefficient c(r) for r in [0, 1]; None: no decay.
LR_DECAY_STYLES: dict[str, Optional[Callable[[float], float]]] = {"constant": None, "linear": _linear, "cosine": _cosine}


class OptimizerParamScheduler:
    """Sets ``lr`` on every param group of ``optimizer`` (a torch optimizer or one of our wrappers).

    Args:
        optimizer: anything with ``param_groups`` (list of dicts).
        lr: peak learning rate (after warmup).
        min_lr: final learning rate of the decay.
        lr_warmup_iters: iterations of linear warmup from 0 (0 = none).
        lr_decay_iters: iteration at which the decay reaches min_lr (counted from 0, warmup
            included); None = no decay (only valid with lr_decay_style=constant).
        lr_decay_style: constant | linear | cosine.
    Raises:
        ConfigError: unknown style; a decaying style without lr_decay_iters; lr_decay_iters <=
            lr_warmup_iters while decaying; negative iterations; min_lr > lr.
    """

    def __init__(
        self,
        optimizer,
        *,
        lr: float,
        min_lr: float,
        lr_warmup_iters: int,
        lr_decay_iters: Optional[int],
        lr_decay_style: str,
    ) -> None:
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(
                f"optim: unknown optim.lr_decay_style={lr_decay_style!r}; pick one of {', '.join(LR_DECAY_STYLES)}"
            )
        if lr_warmup_iters < 0 or (lr_decay_iters is not None and lr_decay_iters < 0):
            raise ConfigError(f"optim: lr_warmup_iters={lr_warmup_iters} and lr_decay_iters={lr_decay_iters} must be >= 0")
        if min_lr > lr:
            raise ConfigError(f"optim: min_lr={min_lr} must be <= lr={lr}")
        if LR_DECAY_STYLES[lr_decay_style] is not None:
            if lr_decay_iters is None:
                raise ConfigError(
                    f"optim: lr_decay_style={lr_decay_style} needs optim.lr_decay_iters (got null = no decay); "
                    "set optim.lr_decay_iters (e.g. to train.train_iters) or optim.lr_decay_style=constant"
                )
            if lr_decay_iters <= lr_warmup_iters:
                raise ConfigError(
                    f"optim: lr_decay_iters={lr_decay_iters} must be > lr_warmup_iters={lr_warmup_iters} "
                    f"for lr_decay_style={lr_decay_style}"
                )
        self.optimizer = optimizer
        self.max_lr = float(lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_iters = int(lr_warmup_iters)
        self.lr_decay_iters = None if lr_decay_iters is None else int(lr_decay_iters)
        self.lr_decay_style = lr_decay_style
        self.num_steps = 0
        self.step(0)  # set the LR of the first iteration

    def get_lr(self) -> float:
        """The LR for the next optimizer step (after ``num_steps`` steps), per the module docstring."""
        n = self.num_steps
        if self.lr_warmup_iters > 0 and n <= self.lr_warmup_iters:
            return self.max_lr * n / self.lr_warmup_iters
        coefficient = LR_DECAY_STYLES[self.lr_decay_style]
        if coefficient is None:
            return self.max_lr
        if n > self.lr_decay_iters:
            return self.min_lr
        ratio = (n - self.lr_warmup_iters) / (self.lr_decay_iters - self.lr_warmup_iters)
        return self.min_lr + coefficient(ratio) * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` iterations (skipped ones included) and set the new LR; returns it."""
        self.num_steps += increment
        new_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr
        return new_lr

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_iters": self.lr_warmup_iters,
            "lr_decay_iters": self.lr_decay_iters,
            "lr_decay_style": self.lr_decay_style,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count; the schedule itself comes from the current config.

        A checkpoint written with other schedule values is loaded with a warning naming them
        (the config wins, as Megatron's ``--override-opt_param-scheduler``).
        """
        for key in ("max_lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style"):
            if key in state_dict and state_dict[key] != getattr(self, key):
                logger.warning("LR schedule: checkpoint has %s=%r, config has %r; using the config",
                               key, state_dict[key], getattr(self, key))
        self.num_steps = int(state_dict["num_steps"])
        self.step(0)
