"""Optimizer wrappers: fp32 main params, loss-scale unscaling, non-finite check, global-norm clipping.

Megatron names: `MegatronOptimizer`, `MixedPrecisionOptimizer`, `Float16OptimizerWithFloat16Params`
and `FP32Optimizer` (megatron/core/optimizer/optimizer.py). `OptimizerWrapper.step`, the one entry
point, runs three phases (Megatron's ``prepare_grads`` / ``step_with_ready_grads``):

1. `prepare_grads`: copy model grads (``grad_fn(param)``: the DP wrapper's main_grad view, fp32 or
   param dtype) into fp32 main grads and look for inf/nan over the grad-stats group(s)
   (model-parallel group; the distributed optimizer adds DP), so every rank takes the same decision;
2. `decide`: skip on non-finite grads (nothing is applied), update the loss scaler, compute the
   global L2 norm over the counted grads (``ShardSpec.counts_on(tp_rank)``) and the clip factor;
3. `apply`: the inner optimizer step on the main params, then copy main params back into the
   model params.

Where the decision is taken:

- on the host (a loss scaler, or an inner optimizer other than torch's fused Adam / AdamW): phase 1
  unscales by 1/S and finds inf/nan in one fused pass
  (`torch._amp_foreach_non_finite_check_and_unscale_`; with no scaler the factor is 1, so bf16/fp32
  non-finite grads are caught too) and phase 2 reads that verdict (one host sync), updates the
  scaler, and on a clean step clips the grads in place (``clip_grad > 0``).
- on the device (no loss scaler, i.e. bf16 / fp32, and a fused torch Adam / AdamW: the folded step):
  phase 1 computes the global norm of the raw grads and their non-finite count in one pass; phase 2
  forms ``found_inf`` (0/1: non-finite count > 0 or the norm is not finite) and the divisor
  1 / (grad_scale × clip coefficient) as tensors, and phase 3 hands both to the fused kernel
  (`torch.amp.GradScaler`'s ``grad_scale`` / ``found_inf`` attributes), which divides every grad by the
  divisor and leaves every param, moment and step count untouched when ``found_inf`` is 1. Nothing
  waits for the host: two passes over the fp32 grads fewer per step (the unscale and clip passes),
  same math, rounding differs by ulps. ``fold_into_fused_step=False`` keeps the host decision.

`step` returns `StepStats`: the step's statistics as one small device tensor (grad norm, skip flag,
zero count) that the trainer reads together with its loss in one device-to-host copy, whenever it
chooses (``train.defer_step_read``); `StepStats.settle` then does the host's bookkeeping (skip
counters, the skip limit) and returns the `StepResult`.

A skipped step counts ``skipped_iters_total``; without a dynamic scaler to explain the overflow it
also counts ``nan_iters_total``.

Checkpoint state: `OptimizerWrapper.sharded_state_dict` lists it (per model param: the fp32 main
param when it is a separate tensor, the inner optimizer's state, the flat range a ZeRO-1 piece
covers; the loss scaler; the skip counters) and `load_sharded_state_dict` takes it back;
`mptrain.checkpoint.state` maps it to layout-independent keys.

Hooks for subclasses (the distributed optimizer, ZeRO-1, overrides "which main params / grads do
I own" and nothing else):

- `_make_main_param(param, spec) -> Parameter | None`: the fp32 main param this rank steps for a
  model param (None: this rank owns none of it). Called once per param by `__init__`. A ZeRO-1
  subclass can instead override `_build_entries` to return `MainParamEntry` subclasses carrying a
  flat range of the param (``flat_range``).
- `_copy_model_grads_to_main_grads()`: fill ``entry.main.grad`` for every entry.
- `_copy_main_params_to_model_params()`: write back after the step (ZeRO-1: shard copy + all-gather over DP).
- `_grad_stats_groups() -> list[ProcessGroup]`: reduced over, in turn, for found_inf (MAX), the
  grad norm and the zero count (SUM). Default ``[groups.mp_group]``; ZeRO-1 adds ``groups.dp_group``.

The LR scheduler sets ``lr`` on `param_groups` (the inner optimizer's). A skipped step still counts
as an iteration but does not advance the schedule (see `mptrain.optim.lr_scheduler`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mptrain.components import ComponentKind
from mptrain.errors import ConfigError
from mptrain.layers.dtypes import HALF_DTYPES
from mptrain.optim.builders import param_groups as build_param_groups
from mptrain.precision.clip_grads import (
    all_reduce_over,
    clip_grads_by_total_norm,
    count_zeros_fp32,
    get_grad_norm_and_non_finite_count_fp32,
    get_grad_norm_fp32,
)
from mptrain.precision.scaler import LossScaler

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step, on the host.

    Attributes:
        update_successful: the params were updated (False on a skipped step).
        grad_norm: global L2 norm of the unscaled grads before clipping; None on a skipped step.
        num_zeros: zero grad elements over the grad-stats group (only with ``log_num_zeros``), else None.
        found_inf: some grad was inf/nan on some rank of the grad-stats group.
        skipped_iters_total / nan_iters_total: the wrapper's counters after this step.
    """

    update_successful: bool
    grad_norm: Optional[float]
    num_zeros: Optional[int]
    found_inf: bool
    skipped_iters_total: int = 0
    nan_iters_total: int = 0


STEP_STATS = ("grad_norm", "skipped", "num_zeros")
"""What `StepStats.values` holds, in order."""


@dataclasses.dataclass(eq=False)
class StepStats:
    """One optimizer step's statistics, not yet read on the host (what `OptimizerWrapper.step` returns).

    Attributes:
        values: float64 ``[3]`` on the grads' device, `STEP_STATS`: the grad norm (nan when skipped),
            1.0 when the step was skipped (non-finite grads) else 0.0, the zero count (nan when not
            counted). The trainer copies it to the host in the same copy as its loss totals.
        on_read: ``list of 3 floats -> StepResult``: the wrapper's host bookkeeping for these values
            (skip counters, the skip limit). Called by `settle`, once, in step order.
    """

    values: torch.Tensor
    on_read: Callable[[list], StepResult]
    _result: Optional[StepResult] = dataclasses.field(default=None, init=False, repr=False)

    def settle(self, values: list) -> StepResult:
        """The `StepResult` for ``values`` (`values` read on the host); later calls return the same
        result without counting the step again.

        Raises:
            TooManySkippedStepsError: as `OptimizerWrapper.step` describes.
        """
        if self._result is None:
            self._result = self.on_read(list(values))
        return self._result

    def result(self) -> StepResult:
        """Read `values` (a host sync) and `settle`: for callers without a buffer of their own."""
        return self._result if self._result is not None else self.settle(self.values.tolist())


def check_max_consecutive_skips(max_consecutive_skips: int) -> None:
    """``loss_scaler.max_consecutive_skips`` is >= 0 (0 = never end the run on skipped steps); pure.

    Raises:
        ConfigError: a negative value (one line naming the key).
    """
    if int(max_consecutive_skips) < 0:
        raise ConfigError(f"loss_scaler.max_consecutive_skips={max_consecutive_skips} must be >= 0 "
                          "(0 = never end the run on skipped steps)")


class TooManySkippedStepsError(RuntimeError):
    """Raised when more than ``max_consecutive_skips`` steps in a row had non-finite grads (one-line message)."""


@dataclasses.dataclass
class MainParamEntry:
    """One main param the inner optimizer steps and the model param it belongs to.

    Attributes:
        model_param: the model's parameter (fp16 / bf16 / fp32).
        spec: its `ShardSpec` (weight decay group; whether its grad counts in the norm).
        main: the fp32 parameter the inner optimizer steps; ``main is model_param`` when no copy
            is kept (fp32 params).
    """

    model_param: torch.nn.Parameter
    spec: object
    main: torch.nn.Parameter

    @property
    def has_copy(self) -> bool:
        return self.main is not self.model_param

    @property
    def flat_range(self) -> Optional[tuple]:
        """Elements [lo, hi) of the flattened model param that ``main`` holds; None: all of it."""
        return None


@dataclasses.dataclass
class ParamState:
    """One model param's part of a wrapper's checkpoint state (`OptimizerWrapper.sharded_state_dict`).

    Attributes:
        param: the model param (the checkpoint knows its global name and `ShardSpec`).
        main: the fp32 main param when it is a tensor of its own (filled in place on load); None when
            the model param itself is stepped.
        state: the inner optimizer's state for it: per-element tensors shaped like ``main`` (or the
            param) and scalars (Adam's ``step``); empty before the first step.
        flat_range: (lo, hi): ``main`` and the per-element state hold elements [lo, hi) of the
            flattened param (a ZeRO-1 piece); None: the whole param.
    """

    param: torch.nn.Parameter
    main: Optional[torch.Tensor]
    state: dict
    flat_range: Optional[tuple] = None


@dataclasses.dataclass
class WrapperState:
    """A wrapper's checkpoint state: what `OptimizerWrapper.sharded_state_dict` lists and
    `OptimizerWrapper.load_sharded_state_dict` takes back (a field left None there: keep what is).

    Attributes:
        params: one `ParamState` per main param this rank steps.
        scaler: the loss scaler's ``state_dict()`` (None: no scaler).
        counters: ``{"skipped_iters_total", "nan_iters_total", "consecutive_skips"}`` (ints).
    """

    params: Optional[list] = None
    scaler: Optional[dict] = None
    counters: Optional[dict] = None


class OptimizerWrapper:
    """Shared logic of `MixedPrecisionOptimizer` and `FP32Optimizer` (see the module docstring).

    The optimizer-wrapper interface (`OPTIMIZER_WRAPPER`), what the trainer and the checkpoint call:
    `step`, `zero_grad`, `get_loss_scale`, `param_groups`, `optimizer` (the inner torch optimizer:
    its class and state keys for the checkpoint's optimizer-change check, its kernel for the
    start-up log), `sharded_state_dict`, `load_sharded_state_dict`.

    Args:
        build_optimizer: ``param_groups -> torch.optim.Optimizer`` (`mptrain.optim.build_optimizer_factory`).
        params: the model params this rank holds, in a stable order (all chunks).
        specs: one `ShardSpec` per param.
        grad_fn: ``param -> grad tensor | None`` (the accumulated grad, same shape as the param).
        groups: `ParallelGroups` (``mp_group``, ``tp_rank``, ``device``).
        scaler: a `LossScaler` or None.
        clip_grad: max global L2 norm (0 = no clipping; the norm is still computed and returned).
        max_consecutive_skips: raise `TooManySkippedStepsError` when the number of consecutive
            skipped steps exceeds this (0 = never raise).
        log_num_zeros: also count zero grads (one more pass and all-reduce per step).
        fold_into_fused_step: take the skip decision on the device where it applies (module docstring).
    Raises:
        ValueError: params and specs differ in length.
    """

    def __init__(
        self,
        build_optimizer: Callable[[list], torch.optim.Optimizer],
        params: list,
        specs: list,
        grad_fn: Callable[[torch.nn.Parameter], Optional[torch.Tensor]],
        groups,
        *,
        scaler: Optional[LossScaler],
        clip_grad: float,
        max_consecutive_skips: int,
        log_num_zeros: bool = False,
        fold_into_fused_step: bool = True,
    ) -> None:
        if len(params) != len(specs):
            raise ValueError(f"{type(self).__name__}: {len(params)} params but {len(specs)} specs")
        self.groups = groups
        self.grad_fn = grad_fn
        self.scaler = scaler
        self.clip_grad = float(clip_grad)
        self.max_consecutive_skips = int(max_consecutive_skips)
        self.log_num_zeros = log_num_zeros
        self.skipped_iters_total = 0
        self.nan_iters_total = 0
        self.consecutive_skips = 0
        self.entries: list[MainParamEntry] = self._build_entries(list(params), list(specs))
        self.optimizer = build_optimizer(
            build_param_groups([e.main for e in self.entries], [e.spec for e in self.entries])
        )
        fused_adam = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(
            self.optimizer.defaults.get("fused"))
        self.folded_step = bool(fold_into_fused_step) and scaler is None and fused_adam
        self._counted_masks: dict = {}  # (counts-in-norm flags, device) -> float mask (`_counted_mask`)

    # --- hooks (override in the distributed optimizer) ----------------------------------
    def _make_main_param(self, param: torch.nn.Parameter, spec) -> Optional[torch.nn.Parameter]:
        raise NotImplementedError

    def _build_entries(self, params: list, specs: list) -> list[MainParamEntry]:
        entries = []
        for p, s in zip(params, specs):
            main = self._make_main_param(p, s)
            if main is not None:
                entries.append(MainParamEntry(p, s, main))
        return entries

    def _copy_model_grads_to_main_grads(self) -> None:
        for e in self.entries:
            grad = self.grad_fn(e.model_param)
            if grad is None:
                e.main.grad = None
                continue
            if grad.shape != e.main.shape:
                raise ValueError(f"grad_fn returned shape {tuple(grad.shape)} for a param of shape {tuple(e.main.shape)}")
            # .float() aliases an fp32 grad (the DP buffer with grad_reduce_in_fp32) and copies an fp16/bf16 one.
            e.main.grad = grad.float()

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        pairs = [(e.model_param, e.main) for e in self.entries if e.has_copy]
        if pairs:
            torch._foreach_copy_([m for m, _ in pairs], [w for _, w in pairs])  # fp32 -> fp16/bf16 (round to nearest)

    def _grad_stats_groups(self) -> list:
        return [self.groups.mp_group]

    def _ep_groups(self) -> list:
        """[ep_group] under expert parallelism (each EP rank holds other experts), else []."""
        return [self.groups.ep_group] if getattr(self.groups, "ep_size", 1) > 1 else []

    def _expert_stats_groups(self) -> list:
        """The groups the expert-parallel grads' norm and zero count are summed over: the grad-stats groups and EP
        (their EDP copies are equal and counted once, as the dense grads' DP copies). ZeRO-1 overrides it."""
        return self._grad_stats_groups() + self._ep_groups()

    def _found_inf_groups(self) -> list:
        """MAX-reduced over for found_inf: the grad-stats groups, and EP, so every rank takes the same decision."""
        return self._grad_stats_groups() + self._ep_groups()

    # --- derived lists ------------------------------------------------------------------
    def _main_grads(self) -> list:
        return [e.main.grad for e in self.entries if e.main.grad is not None]

    def _main_grads_for_norm(self, expert: bool = False) -> list:
        """The counted main grads (`ShardSpec.counts_on`) of the dense params, or of the expert-parallel ones."""
        tp_rank = self.groups.tp_rank
        return [e.main.grad for e in self.entries
                if e.main.grad is not None and e.spec.counts_on(tp_rank) and e.spec.expert_parallel == expert]

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the counted main grads: the dense ones summed over the grad-stats groups, the
        expert-parallel ones (Megatron's ``allreduce=False`` params) over `_expert_stats_groups`."""
        device = self.groups.device
        norm = get_grad_norm_fp32(self._main_grads_for_norm(), self._grad_stats_groups(), device=device)
        if not self._ep_groups():
            return norm
        expert = get_grad_norm_fp32(self._main_grads_for_norm(True), self._expert_stats_groups(), device=device)
        return torch.sqrt(norm * norm + expert.to(norm.device) * expert.to(norm.device))

    # --- the interface ------------------------------------------------------------------
    @property
    def param_groups(self) -> list:
        """The inner optimizer's param groups (the LR scheduler writes ``lr`` here)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        """The loss scale S to multiply the loss by before backward (1.0 without a scaler)."""
        return 1.0 if self.scaler is None else float(self.scaler.scale.item())

    def zero_grad(self) -> None:
        """Drop the main grads and the model params' ``.grad`` (the DP buffer is zeroed by the DDP wrapper)."""
        for e in self.entries:
            e.main.grad = None
            e.model_param.grad = None

    @torch.no_grad()
    def step(self, grad_scale: Optional[torch.Tensor] = None) -> StepStats:
        """One optimizer step: `prepare_grads` → `decide` → `apply` (module docstring). Collective over
        the grad-stats groups. The update is enqueued; on the host path the decision read ``found_inf``.

        Args:
            grad_scale: an extra factor for every grad (0-d tensor, e.g. `finalize.token_scale`),
                multiplied in by the unscale pass (host decision) or the fused kernel (None = 1).
        Returns:
            `StepStats`; its `StepStats.settle` gives the `StepResult` (``update_successful`` False,
            and no param changed, on non-finite grads). Settle each step before the next one's `step`.
        Raises (from `StepStats.settle`):
            TooManySkippedStepsError: more than ``max_consecutive_skips`` skipped steps in a row.
        """
        return StepStats(self.apply(self.decide(self.prepare_grads(grad_scale))), self._settle)

    # --- the phases ---------------------------------------------------------------------
    def prepare_grads(self, grad_scale: Optional[torch.Tensor] = None) -> "_Grads":
        """Phase 1: model grads into the fp32 main grads, and the non-finite check over the grad-stats
        groups (no host sync). Host decision: the grads are unscaled by 1/S × ``grad_scale`` in the same
        pass. Device decision: the global norm and non-finite count of the raw grads in one pass."""
        self._copy_model_grads_to_main_grads()
        if not self.folded_step:
            main_grads = self._main_grads()
            return _Grads(found_inf=self._unscale_and_check(main_grads, grad_scale))
        total_norm, non_finite = self._norm_and_non_finite(expert=False)
        if self._ep_groups():
            expert_norm, expert_non_finite = self._norm_and_non_finite(expert=True)
            total_norm = torch.sqrt(total_norm * total_norm + expert_norm * expert_norm)
            non_finite = non_finite + expert_non_finite
        divisor = torch.ones((), dtype=torch.float32, device=total_norm.device)
        if grad_scale is not None:
            factor = grad_scale.to(device=total_norm.device, dtype=torch.float32).reshape(())
            total_norm, divisor = total_norm * factor, divisor / factor
        # the same decision on every rank (the stats were all-reduced); 1.0 makes the kernel return untouched
        found_inf = ((non_finite > 0) | ~torch.isfinite(total_norm)).float().reshape(())
        return _Grads(found_inf=found_inf, total_norm=total_norm, divisor=divisor)

    def _norm_and_non_finite(self, *, expert: bool) -> tuple:
        """`get_grad_norm_and_non_finite_count_fp32` of the dense main grads over the grad-stats groups, or (with
        expert parallelism) of the expert-parallel ones over `_expert_stats_groups`."""
        tp_rank = self.groups.tp_rank
        pairs = [(e.main.grad, e.spec.counts_on(tp_rank)) for e in self.entries
                 if e.main.grad is not None and (not self._ep_groups() or e.spec.expert_parallel == expert)]
        device = pairs[0][0].device if pairs else self.groups.device
        groups = self._expert_stats_groups() if expert else self._grad_stats_groups()
        return get_grad_norm_and_non_finite_count_fp32(
            [g for g, _ in pairs], self._counted_mask(tuple(c for _, c in pairs), device), groups, device=device)

    def decide(self, grads: "_Grads") -> "_Decision":
        """Phase 2: skip or update, and the clip. Host: reads ``found_inf`` (the step's host sync),
        updates the loss scaler, clips the grads in place. Device: the skip flag and the divisor
        (grad scale × clip coefficient) stay tensors for the fused kernel."""
        stats_groups = self._grad_stats_groups()
        if not self.folded_step:
            found_inf = bool(grads.found_inf.item() > 0)  # host sync, once per step
            if self.scaler is not None:
                self.scaler.update(found_inf)
            if found_inf:
                nan = torch.full((), math.nan, dtype=torch.float64, device=grads.found_inf.device)
                return _Decision(skip=True, total_norm=nan, found_inf=grads.found_inf, num_zeros=nan)
            total_norm = self._grad_norm()
            if self.clip_grad > 0:
                clip_grads_by_total_norm(self._main_grads(), self.clip_grad, total_norm)
            return _Decision(skip=False, total_norm=total_norm, found_inf=grads.found_inf,
                             num_zeros=self._count_zeros(stats_groups, total_norm.device))
        divisor = grads.divisor
        # of the raw grads: a finite non-zero factor keeps zeros zero
        num_zeros = self._count_zeros(stats_groups, grads.total_norm.device)
        if self.clip_grad > 0:  # as clip_grads_by_total_norm: coef = clip / (norm + 1e-6), at most 1
            divisor = divisor / (self.clip_grad / (grads.total_norm + 1e-6)).clamp(max=1.0)
        return _Decision(skip=None, total_norm=grads.total_norm, found_inf=grads.found_inf, num_zeros=num_zeros,
                         divisor=divisor)

    def apply(self, decision: "_Decision") -> torch.Tensor:
        """Phase 3: the inner optimizer step and the copy of the main params into the model params
        (nothing on a host-decided skip; a device-decided skip leaves every value as it was).

        Returns:
            `StepStats.values` of this step (float64 [3] on the grads' device).
        """
        if decision.skip is None:
            # torch's fused Adam divides each grad by grad_scale in the kernel and skips the update on found_inf
            self.optimizer.grad_scale, self.optimizer.found_inf = decision.divisor, decision.found_inf
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
            self._copy_main_params_to_model_params()  # after a skipped update: the values they already hold
        elif not decision.skip:
            self.optimizer.step()
            self._copy_main_params_to_model_params()
        device = decision.total_norm.device
        parts = (decision.total_norm, decision.found_inf, decision.num_zeros)
        return torch.stack([t.to(device=device, dtype=torch.float64).reshape(()) for t in parts])

    # --- helpers of the phases ----------------------------------------------------------
    def _unscale_and_check(self, main_grads: list, grad_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """Unscale ``main_grads`` in place by 1/S × ``grad_scale`` and return found_inf ([1] float32,
        MAX-reduced over the grad-stats groups; no host sync)."""
        device = main_grads[0].device if main_grads else self.groups.device
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if main_grads:
            inv_scale = (torch.ones(1) if self.scaler is None else self.scaler.inv_scale).to(device)
            if grad_scale is not None:  # folded in: one pass over the grads instead of two
                inv_scale = (inv_scale.double() * grad_scale.to(device).reshape(1)).float()
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found_inf, inv_scale)
        all_reduce_over(found_inf, self._found_inf_groups(), dist.ReduceOp.MAX)
        return found_inf

    def _count_zeros(self, stats_groups: list, device) -> torch.Tensor:
        """Zero elements of the counted main grads over the grad-stats groups (``log_num_zeros``), else nan."""
        if not self.log_num_zeros:
            return torch.full((), math.nan, dtype=torch.float64, device=device)
        zeros = count_zeros_fp32(self._main_grads_for_norm(), stats_groups, device=device)
        if self._ep_groups():
            zeros = zeros + count_zeros_fp32(self._main_grads_for_norm(True), self._expert_stats_groups(), device=device)
        return zeros

    def _counted_mask(self, counted: tuple, device: torch.device) -> torch.Tensor:
        """The 0/1 float mask of `counted` on `device`, built once: a fresh host-to-device copy each
        step would be a pageable, synchronising copy in the middle of the step."""
        key = (counted, str(device))
        if key not in self._counted_masks:
            self._counted_masks[key] = torch.tensor(counted, dtype=torch.float32, device=device)
        return self._counted_masks[key]

    def _settle(self, values: list) -> StepResult:
        """The host's side of a step once its `StepStats.values` are read: skip counters, the skip limit."""
        norm, skipped, zeros = values
        if skipped > 0:
            return self._skip()
        self.consecutive_skips = 0
        return StepResult(update_successful=True, grad_norm=norm, num_zeros=None if math.isnan(zeros) else int(zeros),
                          found_inf=False, skipped_iters_total=self.skipped_iters_total,
                          nan_iters_total=self.nan_iters_total)

    def _skip(self) -> StepResult:
        self.skipped_iters_total += 1
        self.consecutive_skips += 1
        explained = self.scaler is not None and self.scaler.dynamic
        if not explained:
            self.nan_iters_total += 1
        logger.info("skipped_iter: non-finite grads; loss scale now %g (%d skipped in a row, %d total)",
                    self.get_loss_scale(), self.consecutive_skips, self.skipped_iters_total)
        for e in self.entries:  # never let a non-finite grad reach a later step
            e.main.grad = None
        if 0 < self.max_consecutive_skips < self.consecutive_skips:
            raise TooManySkippedStepsError(
                f"loss_scaler: {self.consecutive_skips} consecutive steps had inf/nan grads (loss scale "
                f"{self.get_loss_scale():g}) > loss_scaler.max_consecutive_skips={self.max_consecutive_skips}; "
                "lower optim.lr, check the data, or use precision=bf16"
            )
        return StepResult(update_successful=False, grad_norm=None, num_zeros=None, found_inf=True,
                          skipped_iters_total=self.skipped_iters_total, nan_iters_total=self.nan_iters_total)

    # --- checkpointing ------------------------------------------------------------------
    def sharded_state_dict(self) -> WrapperState:
        """This rank's checkpoint state (live tensors, not copies): one `ParamState` per entry, the
        loss scaler's state, the skip counters. `mptrain.checkpoint.state` maps it to its keys."""
        params = [ParamState(e.model_param, e.main if e.has_copy else None, dict(self.optimizer.state.get(e.main, {})),
                             e.flat_range) for e in self.entries]
        return WrapperState(params=params, scaler=None if self.scaler is None else self.scaler.state_dict(),
                            counters={"skipped_iters_total": self.skipped_iters_total,
                                      "nan_iters_total": self.nan_iters_total,
                                      "consecutive_skips": self.consecutive_skips})

    @torch.no_grad()
    def load_sharded_state_dict(self, state: WrapperState) -> None:
        """Take back what `sharded_state_dict` listed, ``params`` in the same order, their ``main``
        already filled in place; a field that is None is left as it is.

        The inner state goes through ``torch.optim.Optimizer.load_state_dict`` so that torch applies its
        own placement rules (``step`` on the param's device for fused / capturable Adam, moments cast to
        the param's dtype and device); params are numbered as torch's ``state_dict()`` numbers them.

        Raises:
            ValueError: ``params`` does not list this rank's entries.
        """
        if state.params is not None:
            if len(state.params) != len(self.entries) or any(
                    p.param is not e.model_param for p, e in zip(state.params, self.entries)):
                raise ValueError(f"{type(self).__name__}.load_sharded_state_dict: the params are not the ones "
                                 "sharded_state_dict listed")
            index = {id(p): n for n, p in enumerate(p for group in self.optimizer.param_groups for p in group["params"])}
            saved = self.optimizer.state_dict()
            saved["state"] = {index[id(e.main)]: dict(p.state) for p, e in zip(state.params, self.entries) if p.state}
            self.optimizer.load_state_dict(saved)
        if state.scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(state.scaler)
        if state.counters is not None:
            self.skipped_iters_total = int(state.counters.get("skipped_iters_total", 0))
            self.nan_iters_total = int(state.counters.get("nan_iters_total", 0))
            self.consecutive_skips = int(state.counters.get("consecutive_skips", 0))


@dataclasses.dataclass
class _Grads:
    """What `OptimizerWrapper.prepare_grads` hands to `decide`: found_inf (0/1 float tensor) and, for
    the device decision, the norm of the raw grads × grad_scale and 1 / grad_scale."""

    found_inf: torch.Tensor
    total_norm: Optional[torch.Tensor] = None
    divisor: Optional[torch.Tensor] = None


@dataclasses.dataclass
class _Decision:
    """What `OptimizerWrapper.decide` hands to `apply`. ``skip``: True / False decided on the host,
    None decided on the device (``found_inf`` and ``divisor`` go to the fused kernel)."""

    skip: Optional[bool]
    total_norm: torch.Tensor
    found_inf: torch.Tensor
    num_zeros: torch.Tensor
    divisor: Optional[torch.Tensor] = None


class MixedPrecisionOptimizer(OptimizerWrapper):
    """fp32 main copies of fp16/bf16 model params (Megatron `Float16OptimizerWithFloat16Params`).

    fp32 model params (if any) are stepped in place, as Megatron's ``fp32_from_fp32_groups``.
    Same arguments as `OptimizerWrapper`.
    """

    def _make_main_param(self, param, spec):
        if param.dtype in HALF_DTYPES:
            return torch.nn.Parameter(param.detach().clone().float())
        if param.dtype == torch.float32:
            return param
        raise ValueError(f"MixedPrecisionOptimizer: unsupported param dtype {param.dtype}")


class FP32Optimizer(OptimizerWrapper):
    """fp32 model params stepped in place (Megatron `FP32Optimizer`); same interface, no main copies.

    Non-finite grads still skip the step (counted in ``nan_iters_total`` when there is no dynamic scaler).
    Raises:
        ValueError: a param is not fp32.
    """

    def _make_main_param(self, param, spec):
        if param.dtype != torch.float32:
            raise ValueError(f"FP32Optimizer: param dtype {param.dtype}; use MixedPrecisionOptimizer for fp16/bf16")
        return param


OPTIMIZER_WRAPPER = ComponentKind(
    "optimizer wrapper", methods=("step", "zero_grad", "get_loss_scale", "sharded_state_dict",
                                  "load_sharded_state_dict"),
    # what `build_optimizer_wrapper` offers (a wrapper takes those its constructor names); never config keys
    runtime_keywords=("build_optimizer", "params", "specs", "grad_fn", "model_chunks", "groups", "scaler",
                      "clip_grad", "max_consecutive_skips"),
    interface=OptimizerWrapper)
"""The optimizer-wrapper kind: the methods above, plus the attributes ``param_groups`` (the LR
schedule writes ``lr``) and ``optimizer`` (the inner torch optimizer), as `OptimizerWrapper` documents."""
BUILTIN_WRAPPERS = (FP32Optimizer, MixedPrecisionOptimizer)
