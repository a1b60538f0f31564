"""The LR schedule component and the built-in Megatron schedule (`OptimizerParamScheduler`).

Interface (`LRScheduler`): built from ``optim.lr_scheduler._target_`` with ``optimizer=`` (anything
with ``param_groups``) by `build_lr_scheduler`, the one place; the Megatron keys of `optim`
(``lr``, ``min_lr``, ``lr_warmup_iters``, ``lr_decay_iters``, ``lr_decay_style``,
``lr_wsd_decay_iters``, ``lr_wsd_decay_style``, ``lr_warmup_fraction``, ``lr_warmup_samples``,
``lr_decay_samples``, ``decoupled_lr``, ``decoupled_min_lr``) and ``train_iters``, ``train_samples``,
``global_batch_size``, ``rampup_batch_size``, ``step_batch_size_schedule`` reach a target only where its
signature takes them (with ``train.rampup_batch_size`` or ``train.step_batch_size_schedule`` set, a target must
take that keyword: `build_lr_scheduler`); keys added with
``+optim.lr_scheduler.<key>=`` go to it as they are. A decoupled-LR key set for a target that does not
take it is an error (the embedding and output layer would run at ``lr`` without a word).

Built-in schedule: Megatron `OptimizerParamScheduler` (megatron/core/optimizer_param_scheduler.py),
stepped once after every applied optimizer step (``step(increment=1)``). Its position ``n`` and its
lengths W (warmup) and D (decay) share one unit, as Megatron's ``get_optimizer_param_scheduler``
(megatron/training/training.py) sets them:

    iteration-based (train.train_iters):  n = applied steps, W = lr_warmup_iters, D = lr_decay_iters
    sample-based (train.train_samples):   n = applied steps × global_batch_size (Megatron's increment:
                                          the samples of one iteration), W = lr_warmup_samples,
                                          D = lr_decay_samples
    batch-size ramp-up (train.rampup_batch_size, sample-based) or step schedule
    (train.step_batch_size_schedule, sample-based):
                                          n = the samples of the applied steps, each step's own global
                                          batch (the trainer calls ``step(increment=<its global batch>)``,
                                          as Megatron's ``opt_param_scheduler.step(increment=...)``)
    step schedule, iteration-based:       n = those samples / global_batch_size, W = lr_warmup_iters,
                                          D = lr_decay_iters (Megatron: n in samples against
                                          lr_*_iters × global_batch_size; the same ratios)
    lr_warmup_fraction f (either unit):   W = f × D, with D = train_iters / train_samples where
                                          lr_decay_iters / lr_decay_samples is null (Megatron's
                                          default for the decay length)

(Megatron counts both in samples, n × global_batch_size against W × global_batch_size: the same
ratios.) The LR used for the next optimizer step is

    n <= W and W > 0     :  lr * n / W                 (warmup; iteration 1 runs at lr 0, as Megatron)
    constant             :  lr
    n > D                :  min_lr
    inverse-square-root  :  max(min_lr, lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))   (D null: no cut at D)
    otherwise            :  min_lr + c * (lr - min_lr),  r = (n - W) / (D - W)
        linear c = 1 - r;   cosine c = (1 + cos(pi r)) / 2  (Loshchilov & Hutter 2017)
        WSD (warmup-stable-decay, Hu et al. 2024 "MiniCPM"): with S = lr_wsd_decay_iters,
            c = 1 for n <= D - S, else with q = (n - (D - S)) / S:
            exponential c = 2 * 0.5^q - 1;  linear 1 - q;  cosine (1 + cos(pi q)) / 2;  minus_sqrt 1 - sqrt(q)

Every param group runs this formula with its own ``lr`` / ``min_lr`` (Megatron reads the group's
``max_lr`` / ``min_lr``): with ``optim.decoupled_lr`` set, the groups of the input embedding and the
output layer (`mptrain.optim.builders.EMBEDDING_OR_OUTPUT`, the tied copy on the last stage included)
get ``max_lr = decoupled_lr`` and ``min_lr = decoupled_min_lr`` (null: ``min_lr``, Megatron's
``_update_min_and_max_lr_in_param_groups``), over the same warmup / decay shape; every other group runs
on ``lr`` / ``min_lr``, and ``get_lr`` (metrics.jsonl's ``lr``) is theirs. The embedding / output LR of a
step is therefore ``decoupled_min_lr + c · (decoupled_lr − decoupled_min_lr)`` for the coefficient ``c``
that ``lr`` shows (``decoupled_lr · n / W`` in warmup).

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
from mptrain.optim.builders import EMBEDDING_OR_OUTPUT

logger = logging.getLogger(__name__)


@runtime_checkable
class LRScheduler(Protocol):
    """What the trainer needs of an LR schedule.

    - constructor: ``cls(optimizer=..., **keywords)``; ``optimizer.param_groups`` is a list of dicts
      whose ``"lr"`` (float, the optimizer's LR units) the schedule sets, for the first iteration
      already in the constructor;
    - ``step(increment=1) -> lr``: advance by ``increment`` applied optimizer steps and set the new LR
      on every group. Called once after each *applied* update: skipped steps (overflow, non-finite
      grads) do not advance it. A schedule built with ``rampup_batch_size=[start, increment, ramp_samples]``
      (``train.rampup_batch_size``; the constructor must take the keyword then) is given the samples of the
      applied step instead: its global batch, which the ramp changes (Megatron's increment);
    - ``get_lr() -> float``: the LR of the next step (what ``metrics.jsonl``'s ``lr`` shows; under
      ``optim.decoupled_lr``, that of the groups other than the embedding / output ones);
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


def schedule_lengths(*, lr_warmup_iters: int, lr_decay_iters: Optional[int], lr_warmup_fraction: Optional[float] = None,
                     train_iters: Optional[int] = None, lr_warmup_samples: int = 0,
                     lr_decay_samples: Optional[int] = None, train_samples: Optional[int] = None,
                     global_batch_size: Optional[int] = None, rampup_batch_size: Optional[list] = None,
                     step_batch_size_schedule: Optional[str] = None) -> tuple[str, int, int, float, Optional[int]]:
    """(unit, samples per ``step`` increment, samples per unit, W, D) of the schedule, per the module docstring;
    unit = "iters" or "samples" (the suffix of the keys that set W and D, for messages). With ``rampup_batch_size``
    or ``step_batch_size_schedule`` the increment is already in samples (1 sample per increment); iteration-based
    with a step schedule, a unit is global_batch_size samples.

    Raises:
        ConfigError: lr_warmup_fraction outside [0, 1], or with lr_warmup_iters / lr_warmup_samples > 0 (Megatron:
            one of them); sample keys without train.train_samples; iteration keys with it; negative lengths;
            rampup_batch_size without train.train_samples; no global_batch_size where a unit needs it.
    """
    if lr_warmup_fraction is not None and not 0.0 <= lr_warmup_fraction <= 1.0:
        raise ConfigError(f"optim.lr_warmup_fraction={lr_warmup_fraction} must be in [0, 1] (the share of the decay "
                          "length spent warming up), or null")
    varying = rampup_batch_size is not None or step_batch_size_schedule is not None
    per_unit = 1
    if train_samples is None:
        if rampup_batch_size is not None:  # the ramp's rule (mptrain.config.batch_size), for a direct caller
            raise ConfigError(f"train.rampup_batch_size={list(rampup_batch_size)} needs training by samples; set "
                              "train.train_samples=<samples> and train.train_iters=null")
        if lr_warmup_samples or lr_decay_samples is not None:
            key, value = (("optim.lr_warmup_samples", lr_warmup_samples) if lr_warmup_samples
                          else ("optim.lr_decay_samples", lr_decay_samples))
            raise ConfigError(f"{key}={value} counts in samples, which needs sample-based training; set "
                              f"train.train_samples (and train.train_iters=null), or {key.replace('samples', 'iters')} "
                              f"instead")
        unit, per_step, warmup, decay, horizon = "iters", 1, lr_warmup_iters, lr_decay_iters, train_iters
        if varying:  # step schedule: the trainer passes each step's samples; an iteration is global_batch_size of them
            if global_batch_size is None:
                raise ConfigError("train.step_batch_size_schedule with train.train_iters needs train.global_batch_size "
                                  "(the samples of one iteration of the LR lengths)")
            per_unit = int(global_batch_size)
    else:
        for key, value, off in (("optim.lr_warmup_iters", lr_warmup_iters, 0), ("optim.lr_decay_iters", lr_decay_iters,
                                                                                None)):
            if value != off:
                raise ConfigError(f"{key}={value} counts in iterations, but train.train_samples={train_samples} "
                                  f"counts the schedule in samples; set {key.replace('iters', 'samples')} instead "
                                  f"and {key}={'null' if off is None else off}")
        if global_batch_size is None:
            raise ConfigError("train.train_samples needs train.global_batch_size (the samples of one iteration)")
        # with a varying batch the trainer passes each step's samples; else one step = one batch
        per_step = 1 if varying else int(global_batch_size)
        unit, warmup, decay, horizon = "samples", lr_warmup_samples, lr_decay_samples, train_samples
    if warmup < 0 or (decay is not None and decay < 0):
        raise ConfigError(f"optim: lr_warmup_{unit}={warmup} and lr_decay_{unit}={decay} must be >= 0")
    if lr_warmup_fraction is not None:
        if warmup > 0:
            raise ConfigError(f"optim.lr_warmup_fraction={lr_warmup_fraction} and optim.lr_warmup_{unit}={warmup} "
                              f"both set the warmup; set optim.lr_warmup_{unit}=0 or optim.lr_warmup_fraction=null")
        base = decay if decay is not None else horizon
        if base is None:
            raise ConfigError(f"optim.lr_warmup_fraction={lr_warmup_fraction} needs optim.lr_decay_{unit} or "
                              f"train.train_{unit} (the length it is a fraction of); set one")
        warmup = lr_warmup_fraction * base  # Megatron: lr_warmup_steps = lr_warmup_fraction * lr_decay_steps
    return unit, per_step, per_unit, warmup, decay


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
        lr_warmup_fraction: warmup = this × the decay length (None = lr_warmup_iters / lr_warmup_samples).
        train_iters: the run's iterations (the decay length lr_warmup_fraction uses when lr_decay_iters is None).
        lr_warmup_samples, lr_decay_samples, train_samples: the sample-based counterparts (train_samples set:
            the schedule counts samples, ``global_batch_size`` per applied step).
        global_batch_size: samples per iteration.
        rampup_batch_size: ``train.rampup_batch_size`` ([start, increment, ramp_samples]) or None; set, ``step``'s
            increment is the applied step's samples (its global batch), as Megatron's.
        step_batch_size_schedule: ``train.step_batch_size_schedule`` or None; set, likewise (iteration-based: the
            position counts those samples in iterations of global_batch_size).
        decoupled_lr: peak LR of the param groups marked `EMBEDDING_OR_OUTPUT` (None: they run on ``lr``).
        decoupled_min_lr: their final LR (None: ``min_lr``).
    Raises:
        ConfigError: unknown style; a decaying style without a decay length; decay length <= warmup
            while decaying; negative lengths; min_lr > lr; WSD lengths out of range; `schedule_lengths`'s rules;
            `check_decoupled_lr`'s.
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
        lr_warmup_fraction: Optional[float] = None,
        train_iters: Optional[int] = None,
        lr_warmup_samples: int = 0,
        lr_decay_samples: Optional[int] = None,
        train_samples: Optional[int] = None,
        global_batch_size: Optional[int] = None,
        rampup_batch_size: Optional[list] = None,
        step_batch_size_schedule: Optional[str] = None,
        decoupled_lr: Optional[float] = None,
        decoupled_min_lr: Optional[float] = None,
    ) -> None:
        unit, self.samples_per_step, self.samples_per_unit, self.lr_warmup_steps, self.lr_decay_steps = schedule_lengths(
            lr_warmup_iters=lr_warmup_iters, lr_decay_iters=lr_decay_iters, lr_warmup_fraction=lr_warmup_fraction,
            train_iters=train_iters, lr_warmup_samples=lr_warmup_samples, lr_decay_samples=lr_decay_samples,
            train_samples=train_samples, global_batch_size=global_batch_size, rampup_batch_size=rampup_batch_size,
            step_batch_size_schedule=step_batch_size_schedule)
        check_lr_schedule_values(lr=lr, min_lr=min_lr, lr_warmup_iters=self.lr_warmup_steps,
                                 lr_decay_iters=self.lr_decay_steps, lr_decay_style=lr_decay_style,
                                 lr_wsd_decay_iters=lr_wsd_decay_iters, lr_wsd_decay_style=lr_wsd_decay_style, unit=unit)
        self.optimizer = optimizer
        self.max_lr = float(lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_iters = int(lr_warmup_iters)
        self.lr_decay_iters = None if lr_decay_iters is None else int(lr_decay_iters)
        self.lr_decay_style = lr_decay_style
        self.lr_wsd_decay_iters = None if lr_wsd_decay_iters is None else int(lr_wsd_decay_iters)
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.lr_warmup_fraction = lr_warmup_fraction
        self.lr_warmup_samples = int(lr_warmup_samples)
        self.lr_decay_samples = None if lr_decay_samples is None else int(lr_decay_samples)
        check_decoupled_lr(min_lr=self.min_lr, decoupled_lr=decoupled_lr, decoupled_min_lr=decoupled_min_lr)
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)
        self.decoupled_min_lr = None if decoupled_min_lr is None else float(decoupled_min_lr)
        if self.decoupled_lr is not None:
            # the groups carry their own LR range, as Megatron's param groups do (`_lr_of` reads it)
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            for group in optimizer.param_groups:
                if group.get(EMBEDDING_OR_OUTPUT):
                    group["max_lr"], group["min_lr"] = self.decoupled_lr, low
        self.num_steps = 0
        self.step(0)  # set the LR of the first iteration

    def get_lr(self) -> float:
        """The LR for the next optimizer step (after ``num_steps`` steps) of the groups on ``lr`` / ``min_lr``,
        per the module docstring."""
        return self._lr_of(self.max_lr, self.min_lr)

    def _lr_of(self, max_lr: float, min_lr: float) -> float:
        """The schedule's LR for the next step of a group whose range is [min_lr, max_lr] (Megatron's
        ``get_lr(param_group)``)."""
        n, w, d = self.num_steps * self.samples_per_step, self.lr_warmup_steps, self.lr_decay_steps
        if self.samples_per_unit != 1:  # iteration-based with a step schedule: samples -> iterations of the unit
            n = n / self.samples_per_unit
        if w > 0 and n <= w:
            return max_lr * n / w
        if self.lr_decay_style == "constant":
            return max_lr
        if d is not None and n > d:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(w, 1) ** 0.5 / max(n, 1) ** 0.5)
        if self.lr_decay_style == "WSD":
            anneal_start = d - self.lr_wsd_decay_iters
            coefficient = 1.0 if n <= anneal_start else LR_WSD_DECAY_STYLES[self.lr_wsd_decay_style](
                (n - anneal_start) / self.lr_wsd_decay_iters)
        else:
            coefficient = _DECAY[self.lr_decay_style]((n - w) / (d - w))
        return min_lr + coefficient * (max_lr - min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance by ``increment`` applied optimizer steps (with a ramp or a step schedule: samples) and set every group's new LR
        (its own range: the embedding / output groups' under ``decoupled_lr``); returns `get_lr`'s."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr_of(group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr))
        return self.get_lr()

    _SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_wsd_decay_iters",
                      "lr_wsd_decay_style", "lr_warmup_fraction", "lr_warmup_samples", "lr_decay_samples",
                      "samples_per_step", "samples_per_unit", "decoupled_lr", "decoupled_min_lr")

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


def check_decoupled_lr(*, min_lr: float, decoupled_lr: Optional[float], decoupled_min_lr: Optional[float]) -> None:
    """The rules of ``optim.decoupled_lr`` / ``optim.decoupled_min_lr`` (Megatron's ``--decoupled-lr`` /
    ``--decoupled-min-lr``): the embedding and output layer's range [decoupled_min_lr (null: min_lr), decoupled_lr].

    Raises:
        ConfigError: decoupled_min_lr without decoupled_lr (it would change nothing); a negative value; the
            range's low end above decoupled_lr.
    """
    if decoupled_lr is None:
        if decoupled_min_lr is not None:
            raise ConfigError(f"optim.decoupled_min_lr={decoupled_min_lr} has no effect without optim.decoupled_lr (the "
                              "embedding and output layer's peak LR); set optim.decoupled_lr, or "
                              "optim.decoupled_min_lr=null")
        return
    if decoupled_lr < 0 or (decoupled_min_lr is not None and decoupled_min_lr < 0):
        raise ConfigError(f"optim.decoupled_lr={decoupled_lr} and optim.decoupled_min_lr={decoupled_min_lr} must be "
                          ">= 0 (null: off / optim.min_lr)")
    if decoupled_min_lr is None and min_lr > decoupled_lr:
        raise ConfigError(f"optim.min_lr={min_lr} (the embedding and output layer's final LR while "
                          f"optim.decoupled_min_lr is null) must be <= optim.decoupled_lr={decoupled_lr}; set "
                          "optim.decoupled_min_lr")
    if decoupled_min_lr is not None and decoupled_min_lr > decoupled_lr:
        raise ConfigError(f"optim.decoupled_min_lr={decoupled_min_lr} must be <= optim.decoupled_lr={decoupled_lr}; "
                          "lower optim.decoupled_min_lr")


def check_lr_schedule_values(*, lr, min_lr, lr_warmup_iters, lr_decay_iters, lr_decay_style, lr_wsd_decay_iters,
                             lr_wsd_decay_style, unit: str = "iters") -> None:
    """The Megatron LR keys' rules, once (the built-in schedule calls it; so does the start-up check).
    ``lr_warmup_iters`` / ``lr_decay_iters``: W and D in the schedule's unit (`schedule_lengths`); ``unit`` = "iters"
    or "samples" names the keys that set them.

    Raises:
        ConfigError: see `OptimizerParamScheduler`.
    """
    if lr_decay_style not in LR_DECAY_STYLES:
        raise ConfigError(
            f"optim: unknown optim.lr_decay_style={lr_decay_style!r}; pick one of {', '.join(LR_DECAY_STYLES)}"
        )
    if lr_warmup_iters < 0 or (lr_decay_iters is not None and lr_decay_iters < 0):
        raise ConfigError(f"optim: lr_warmup_{unit}={lr_warmup_iters} and lr_decay_{unit}={lr_decay_iters} must be >= 0")
    if min_lr > lr:
        raise ConfigError(f"optim: min_lr={min_lr} must be <= lr={lr}")
    if LR_DECAY_STYLES[lr_decay_style]:
        if lr_decay_iters is None:
            raise ConfigError(
                f"optim: lr_decay_style={lr_decay_style} needs optim.lr_decay_{unit} (got null = no decay); "
                f"set optim.lr_decay_{unit} (e.g. to train.train_{unit}) or optim.lr_decay_style=constant"
            )
        if lr_decay_iters <= lr_warmup_iters:
            raise ConfigError(
                f"optim: lr_decay_{unit}={lr_decay_iters} must be > lr_warmup_{unit}={lr_warmup_iters} "
                f"for lr_decay_style={lr_decay_style}"
            )
    if lr_decay_style == "WSD":
        if unit == "samples":
            raise ConfigError("optim.lr_decay_style=WSD counts its final decay in iterations (optim.lr_wsd_decay_iters); "
                              "with train.train_samples pick another optim.lr_decay_style, or train by train.train_iters")
        if lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
            raise ConfigError(f"optim: unknown optim.lr_wsd_decay_style={lr_wsd_decay_style!r}; pick one of "
                              f"{', '.join(LR_WSD_DECAY_STYLES)}")
        span = lr_decay_iters - lr_warmup_iters
        if lr_wsd_decay_iters is None or not 1 <= lr_wsd_decay_iters <= span:
            raise ConfigError(
                f"optim: lr_decay_style=WSD needs 1 <= optim.lr_wsd_decay_iters <= lr_decay_iters - lr_warmup_iters = "
                f"{span} (got {lr_wsd_decay_iters}); set optim.lr_wsd_decay_iters, e.g. to {max(1, span // 10)}"
            )


def scheduler_keywords(optim_cfg, train_iters: Optional[int], *, train_samples: Optional[int] = None,
                       global_batch_size: Optional[int] = None, rampup_batch_size: Optional[list] = None,
                       step_batch_size_schedule: Optional[str] = None) -> dict:
    """The Megatron-named keys a schedule target may take (each passed only if its signature takes it)."""
    keys = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_wsd_decay_iters",
            "lr_wsd_decay_style", "lr_warmup_fraction", "lr_warmup_samples", "lr_decay_samples", "decoupled_lr",
            "decoupled_min_lr")
    return {**{k: getattr(optim_cfg, k) for k in keys}, "train_iters": train_iters, "train_samples": train_samples,
            "global_batch_size": global_batch_size,
            "rampup_batch_size": None if rampup_batch_size is None else [int(v) for v in rampup_batch_size],
            "step_batch_size_schedule": step_batch_size_schedule}


def build_lr_scheduler(optim_cfg, optimizer, *, train_iters: Optional[int] = None, train_samples: Optional[int] = None,
                       global_batch_size: Optional[int] = None, rampup_batch_size: Optional[list] = None,
                       step_batch_size_schedule: Optional[str] = None):
    """The LR schedule of ``optim.lr_scheduler`` for ``optimizer`` (the one place it is built).

    Raises:
        ConfigError: the component checks (`mptrain.components.build`) or the schedule's own rules; with
            ``rampup_batch_size`` or ``step_batch_size_schedule`` a target whose constructor does not take that
            keyword (its ``step`` would read the samples the trainer passes as optimizer steps); a decoupled-LR key
            set for a target that does not take it.
    """
    key, node = "optim.lr_scheduler", optim_cfg.lr_scheduler
    mapped = scheduler_keywords(optim_cfg, train_iters, train_samples=train_samples,
                                global_batch_size=global_batch_size, rampup_batch_size=rampup_batch_size,
                                step_batch_size_schedule=step_batch_size_schedule)
    _, taken = components.resolve(key, node, LR_SCHEDULER, mapped=mapped)
    for name in ("rampup_batch_size", "step_batch_size_schedule"):
        if mapped[name] is not None and name not in taken:
            target = components.node_items(node).get("_target_")
            raise ConfigError(f"{key}._target_={target} does not take {name}, which train.{name} needs (the trainer "
                              "then steps the schedule by each step's samples); add the keyword to its constructor, "
                              f"or set train.{name}=null")
    for name in ("decoupled_lr", "decoupled_min_lr"):
        if mapped[name] is not None and name not in taken:  # silently dropped, the embedding would run at lr
            raise ConfigError(f"optim.{name}={mapped[name]}: {key}._target_={components.node_items(node).get('_target_')}"
                              f" does not take {name}; set optim.{name}=null or use a schedule that takes it "
                              f"({__name__}.OptimizerParamScheduler does)")
    return components.build(key, node, LR_SCHEDULER, runtime={"optimizer": optimizer}, mapped=mapped,
                            partial=False)  # `_partial_: true` says the runtime passes the optimizer: it does, here


def check_lr_scheduler(optim_cfg, train_iters: Optional[int] = None, optimizer=None, *,
                       train_samples: Optional[int] = None, global_batch_size: Optional[int] = None,
                       rampup_batch_size: Optional[list] = None, step_batch_size_schedule: Optional[str] = None) -> None:
    """Start-up check (pure): build a throwaway schedule on ``optimizer`` (a stand-in with one param group
    when None), so a bad target or bad LR keys are one ConfigError line before any collective."""
    if optimizer is None:
        optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0}])
    build_lr_scheduler(optim_cfg, optimizer, train_iters=train_iters, train_samples=train_samples,
                       global_batch_size=global_batch_size, rampup_batch_size=rampup_batch_size,
                       step_batch_size_schedule=step_batch_size_schedule)
