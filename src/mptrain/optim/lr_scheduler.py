"""The LR schedule component and the built-in Megatron schedule (`OptimizerParamScheduler`).

Interface (`LRScheduler`): built from ``optim.lr_scheduler._target_`` with ``optimizer=`` (anything
with ``param_groups``) by `build_lr_scheduler`, the one place; the Megatron keys of `optim`
(``lr``, ``min_lr``, ``lr_warmup_iters``, ``lr_decay_iters``, ``lr_decay_style``,
``lr_wsd_decay_iters``, ``lr_wsd_decay_style``) and ``train_iters`` reach a target only where its
signature takes them; keys added with ``+optim.lr_scheduler.<key>=`` go to it as they are.

Built-in schedule: Megatron `OptimizerParamScheduler` (megatron/core/optimizer_param_scheduler.py),
counted in iterations (``step(increment=1)`` after every applied optimizer step). With ``n`` =
steps taken so far, W = lr_warmup_iters, D = lr_decay_iters, the LR used for the next optimizer
step is

    n <= W and W > 0     :  lr * n / W                 (warmup; iteration 1 runs at lr 0, as Megatron)
    constant             :  lr
    n > D                :  min_lr
    inverse-square-root  :  max(min_lr, lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))   (D null: no cut at D)
    otherwise            :  min_lr + c * (lr - min_lr),  r = (n - W) / (D - W)
        linear c = 1 - r;   cosine c = (1 + cos(pi r)) / 2  (Loshchilov & Hutter 2017)
        WSD (warmup-stable-decay, Hu et al. 2024 "MiniCPM"): with S = lr_wsd_decay_iters,
            c = 1 for n <= D - S, else with q = (n - (D - S)) / S:
            exponential c = 2 * 0.5^q - 1;  linear 1 - q;  cosine (1 + cos(pi q)) / 2;  minus_sqrt 1 - sqrt(q)

Skipped steps (fp16 overflow, non-finite grads): the iteration counter advances (a skipped
iteration counts toward ``train_iters``), the LR schedule does not — the training loop calls
`step` only after an applied update (Megatron's ``train_step``: ``if update_successful:
opt_param_scheduler.step(...)``). A run of ``train_iters`` iterations therefore applies at most
``train_iters`` updates, and the schedule position equals the number of applied updates.
"""

from __future__ import annotations

import logging
import math
import types
from typing import Callable, Optional, Protocol, runtime_checkable

from mptrain import components
from mptrain.errors import ConfigError

logger = logging.getLogger(__name__)


@runtime_checkable
class LRScheduler(Protocol):
    """What the trainer needs of an LR schedule.

    - constructor: ``cls(optimizer=..., **keywords)``; ``optimizer.param_groups`` is a list of dicts
      whose ``"lr"`` (float, the optimizer's LR units) the schedule sets, for the first iteration
      already in the constructor;
    - ``step(increment=1) -> lr``: advance by ``increment`` applied optimizer steps and set the new LR
      on every group. Called once after each *applied* update: skipped steps (overflow, non-finite
      grads) do not advance it;
    - ``get_lr() -> float``: the LR of the next step (what ``metrics.jsonl``'s ``lr`` shows);
    - ``state_dict() -> dict`` (picklable, saved in every checkpoint) / ``load_state_dict(sd)``
      (restore the position; called after construction on resume).
    """

    def step(self, increment: int = 1) -> float: ...

    def get_lr(self) -> float: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


LR_SCHEDULER = components.ComponentKind(
    "LR schedule", methods=("step", "get_lr", "state_dict", "load_state_dict"), runtime_keywords=("optimizer",),
    interface=LRScheduler)


def _linear(ratio: float) -> float:
    return 1.0 - ratio


def _cosine(ratio: float) -> float:
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


def _exponential(ratio: float) -> float:
    return 2.0 * math.pow(0.5, ratio) - 1.0


def _minus_sqrt(ratio: float) -> float:
    return 1.0 - math.sqrt(ratio)


# lr_decay_style -> needs lr_decay_iters (the closed Megatron choice; validated from this table only).
LR_DECAY_STYLES: dict[str, bool] = {"constant": False, "linear": True, "cosine": True, "inverse-square-root": False,
                                    "WSD": True}
# lr_wsd_decay_style -> coefficient c(q) of the final WSD decay, q in [0, 1].
LR_WSD_DECAY_STYLES: dict[str, Callable[[float], float]] = {"exponential": _exponential, "linear": _linear,
                                                            "cosine": _cosine, "minus_sqrt": _minus_sqrt}
_DECAY = {"linear": _linear, "cosine": _cosine}


class OptimizerParamScheduler:
    """Sets ``lr`` on every param group of ``optimizer`` (a torch optimizer or one of our wrappers).

    Args:
        optimizer: anything with ``param_groups`` (list of dicts).
        lr: peak learning rate (after warmup).
        min_lr: final learning rate of the decay.
        lr_warmup_iters: iterations of linear warmup from 0 (0 = none).
        lr_decay_iters: iteration at which the decay reaches min_lr (counted from 0, warmup
            included); None = no decay (constant, or inverse-square-root without the cut).
        lr_decay_style: constant | linear | cosine | inverse-square-root | WSD.
        lr_wsd_decay_iters: WSD: length of the final decay (1 <= it <= lr_decay_iters - lr_warmup_iters).
        lr_wsd_decay_style: WSD: exponential | linear | cosine | minus_sqrt.
    Raises:
        ConfigError: unknown style; a decaying style without lr_decay_iters; lr_decay_iters <=
            lr_warmup_iters while decaying; negative iterations; min_lr > lr; WSD lengths out of range.
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
        lr_wsd_decay_iters: Optional[int] = None,
        lr_wsd_decay_style: str = "exponential",
    ) -> None:
        check_lr_schedule_values(lr=lr, min_lr=min_lr, lr_warmup_iters=lr_warmup_iters, lr_decay_iters=lr_decay_iters,
                                 lr_decay_style=lr_decay_style, lr_wsd_decay_iters=lr_wsd_decay_iters,
                                 lr_wsd_decay_style=lr_wsd_decay_style)
        self.optimizer = optimizer
        self.max_lr = float(lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_iters = int(lr_warmup_iters)
        self.lr_decay_iters = None if lr_decay_iters is None else int(lr_decay_iters)
        self.lr_decay_style = lr_decay_style
        self.lr_wsd_decay_iters = None if lr_wsd_decay_iters is None else int(lr_wsd_decay_iters)
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.num_steps = 0
        self.step(0)  # set the LR of the first iteration

    def get_lr(self) -> float:
        """The LR for the next optimizer step (after ``num_steps`` steps), per the module docstring."""
        n, w, d = self.num_steps, self.lr_warmup_iters, self.lr_decay_iters
        if w > 0 and n <= w:
            return self.max_lr * n / w
        if self.lr_decay_style == "constant":
            return self.max_lr
        if d is not None and n > d:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(w, 1) ** 0.5 / max(n, 1) ** 0.5)
        if self.lr_decay_style == "WSD":
            anneal_start = d - self.lr_wsd_decay_iters
            coefficient = 1.0 if n <= anneal_start else LR_WSD_DECAY_STYLES[self.lr_wsd_decay_style](
                (n - anneal_start) / self.lr_wsd_decay_iters)
        else:
            coefficient = _DECAY[self.lr_decay_style]((n - w) / (d - w))
        return self.min_lr + coefficient * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` applied optimizer steps and set the new LR; returns it."""
        self.num_steps += increment
        new_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr
        return new_lr

    _SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_wsd_decay_iters",
                      "lr_wsd_decay_style")

    def state_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self._SCHEDULE_KEYS}, "num_steps": self.num_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count; the schedule itself comes from the current config.

        A checkpoint written with other schedule values is loaded with a warning naming them
        (the config wins, as Megatron's ``--override-opt_param-scheduler``).
        """
        for key in self._SCHEDULE_KEYS:
            if key in state_dict and state_dict[key] != getattr(self, key):
                logger.warning("LR schedule: checkpoint has %s=%r, config has %r; using the config",
                               key, state_dict[key], getattr(self, key))
        self.num_steps = int(state_dict["num_steps"])
        self.step(0)


def check_lr_schedule_values(*, lr, min_lr, lr_warmup_iters, lr_decay_iters, lr_decay_style, lr_wsd_decay_iters,
                             lr_wsd_decay_style) -> None:
    """The Megatron LR keys' rules, once (the built-in schedule calls it; so does the start-up check).

    Raises:
        ConfigError: see `OptimizerParamScheduler`.
    """
    if lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(
            f"optim: unknown optim.lr_decay_style={lr_decay_style!r}; pick one of {', '.join(LR_DECAY_STYLES)}"
        )
    if lr_warmup_iters < 0 or (lr_decay_iters is not None and lr_decay_iters < 0):
        raise ConfigError(f"optim: lr_warmup_iters={lr_warmup_iters} and lr_decay_iters={lr_decay_iters} must be >= 0")
    if min_lr > lr:
        raise ConfigError(f"optim: min_lr={min_lr} must be <= lr={lr}")
    if LR_DECAY_STYLES[lr_decay_style]:
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
    if lr_decay_style == "WSD":
        if lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
            raise ConfigError(f"optim: unknown optim.lr_wsd_decay_style={lr_wsd_decay_style!r}; pick one of "
                              f"{', '.join(LR_WSD_DECAY_STYLES)}")
        span = lr_decay_iters - lr_warmup_iters
        if lr_wsd_decay_iters is None or not 1 <= lr_wsd_decay_iters <= span:
            raise ConfigError(
                f"optim: lr_decay_style=WSD needs 1 <= optim.lr_wsd_decay_iters <= lr_decay_iters - lr_warmup_iters = "
                f"{span} (got {lr_wsd_decay_iters}); set optim.lr_wsd_decay_iters, e.g. to {max(1, span // 10)}"
            )


def scheduler_keywords(optim_cfg, train_iters: Optional[int]) -> dict:
    """The Megatron-named keys a schedule target may take (each passed only if its signature takes it)."""
    keys = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_wsd_decay_iters",
            "lr_wsd_decay_style")
    return {**{k: getattr(optim_cfg, k) for k in keys}, "train_iters": train_iters}


def build_lr_scheduler(optim_cfg, optimizer, *, train_iters: Optional[int] = None):
    """The LR schedule of ``optim.lr_scheduler`` for ``optimizer`` (the one place it is built).

    Raises:
        ConfigError: the component checks (`mptrain.components.build`) or the schedule's own rules.
    """
    return components.build("optim.lr_scheduler", optim_cfg.lr_scheduler, LR_SCHEDULER,
                            runtime={"optimizer": optimizer}, mapped=scheduler_keywords(optim_cfg, train_iters),
                            partial=False)  # `_partial_: true` says the runtime passes the optimizer: it does, here


def check_lr_scheduler(optim_cfg, train_iters: Optional[int] = None, optimizer=None) -> None:
    """Start-up check (pure): build a throwaway schedule on ``optimizer`` (a stand-in with one param group
    when None), so a bad target or bad LR keys are one ConfigError line before any collective."""
    if optimizer is None:
        optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0}])
    build_lr_scheduler(optim_cfg, optimizer, train_iters=train_iters)
