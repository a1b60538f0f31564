"""Optimizer wrappers: fp32 main params, loss-scale unscaling, non-finite check, global-norm clipping.

Megatron names: `MegatronOptimizer`, `MixedPrecisionOptimizer`, `Float16OptimizerWithFloat16Params`
and `FP32Optimizer` (megatron/core/optimizer/optimizer.py). ``step()`` runs, in order:

1. copy model grads (``grad_fn(param)``: the DP wrapper's main_grad view, fp32 or param dtype)
   into fp32 main grads;
2. unscale by 1/S and detect inf/nan in one fused pass (`torch._amp_foreach_non_finite_check_and_unscale_`;
   with no scaler the factor is 1, so bf16/fp32 non-finite grads are caught too);
3. all-reduce found_inf with MAX over the grad-stats group(s) (model-parallel group; the
   distributed optimizer adds DP), so every rank takes the same decision; update the scaler;
4. on non-finite grads: skip (count ``skipped_iters_total``; without a dynamic scaler to explain
   the overflow also ``nan_iters_total``), nothing is applied;
5. otherwise: global L2 norm over the counted grads (``ShardSpec.counts_on(tp_rank)``, reduced
   over the grad-stats groups), clip by it when ``clip_grad > 0``, optional zero count, inner
   optimizer step on the main params, copy main params back into the model params.

Folded step (no loss scaler, i.e. bf16 / fp32, and a fused torch Adam / AdamW inner optimizer):
steps 2 and 5's clip pass are folded into the fused kernel. The global norm of the raw grads
(one pass) times ``grad_scale`` is the norm; a non-finite norm means a non-finite grad (skip, as
step 4); otherwise the kernel divides every grad by its ``grad_scale`` attribute (the one
`torch.amp.GradScaler` uses) = 1 / (grad_scale × clip coefficient). Two passes over the fp32
grads fewer per step (the separate unscale and clip passes; bench/reports/2026-11-30-megatron-core.md);
same math, rounding differs by ulps. ``fold_into_fused_step=False`` keeps the five steps.

The folded step also makes its skip decision on the device: the kernel gets the 0/1 ``found_inf``
tensor (``non-finite count > 0 or the norm is not finite``; again `GradScaler`'s attribute) and
leaves every param, moment and step count as they were when it is 1. So `launch_step` enqueues the
whole update without waiting for the host and returns a `PendingStep`: its `PendingStep.result`
reads the norm, the non-finite count (and the caller's ``read_along``) later, in one host read,
and does the host's bookkeeping (skip counters, the skip limit). `step` is ``launch_step().result()``.
The other paths (a loss scaler, a non-fused inner optimizer) decide on the host inside
`launch_step` and return an already settled `PendingStep`.

Hooks for subclasses (the distributed optimizer, ZeRO-1, overrides "which main params / grads do
I own" and nothing else):

- `_make_main_param(param, spec) -> Parameter | None`: the fp32 main param this rank steps for a
  model param (None: this rank owns none of it). Called once per param by `__init__`. A ZeRO-1
  subclass can instead override `_build_entries` to return `MainParamEntry` subclasses carrying a
  range into the param.
- `_copy_model_grads_to_main_grads()`: fill ``entry.main.grad`` for every entry.
- `_copy_main_params_to_model_params()` / `_copy_model_params_to_main_params()`: write back after
  the step (ZeRO-1: shard copy + all-gather over DP) / reload after the model params changed.
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

from mptrain.components import ComponentKind, accepted_keywords, build, extra_keys, resolve
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
from mptrain.precision.flat_adam import FlatAdamStep, why_not_flat
from mptrain.precision.scaler import LossScaler

logger = logging.getLogger(__name__)

_HALF = HALF_DTYPES


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step.

    Attributes:
        update_successful: the params were updated (False on a skipped step).
        grad_norm: global L2 norm of the unscaled grads before clipping; None on a skipped step.
        num_zeros: zero grad elements over the grad-stats group (only with ``log_num_zeros``), else None.
        found_inf: some grad was inf/nan on some rank of the grad-stats group.
        read_along: the values of ``step(read_along=...)``'s tensor, read on the host with the
            step's own host read (None without it).
    """

    update_successful: bool
    grad_norm: Optional[float]
    num_zeros: Optional[int]
    found_inf: bool
    read_along: Optional[tuple] = None


class PendingStep:
    """An optimizer step whose update is enqueued and whose outcome is read on the host later
    (`OptimizerWrapper.launch_step`; the module docstring's folded step).

    ``stats``: float64 ``[norm, non-finite count, zero count or nan, *read_along]``, filled (on CUDA
    into pinned host memory, asynchronously) by the time ``ready`` (a CUDA event, or None on the CPU)
    has fired. `result` waits for it (the step's one host read), settles the step with the wrapper
    once, and returns the same `StepResult` on every later call.
    """

    def __init__(self, wrapper: "OptimizerWrapper", stats: Optional[torch.Tensor] = None, ready=None,
                 has_along: bool = False, result: Optional[StepResult] = None) -> None:
        self._wrapper, self._stats, self._ready, self._has_along = wrapper, stats, ready, has_along
        self._result = result

    @classmethod
    def settled(cls, result: StepResult) -> "PendingStep":
        """A step already decided on the host (the unfolded paths)."""
        return cls(None, result=result)

    @property
    def is_settled(self) -> bool:
        return self._result is not None

    def result(self) -> StepResult:
        """The step's `StepResult` (a host sync the first time; cheap when ``ready`` has fired).

        Raises:
            TooManySkippedStepsError: as `OptimizerWrapper.step`, on the call that settles it.
        """
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            norm, non_finite, zeros, *along = self._stats.tolist()
            wrapper, self._wrapper = self._wrapper, None  # settled once, even when settling raises
            if wrapper is None:
                raise RuntimeError("PendingStep: settling it raised before; the step's outcome is lost")
            self._result = wrapper._settle(norm, non_finite, None if math.isnan(zeros) else int(zeros),
                                           tuple(along) if self._has_along else None)
        return self._result


def _to_host_async(stats: torch.Tensor) -> tuple:
    """(host tensor, event): ``stats`` copied to pinned host memory behind the work enqueued so far,
    without waiting for it (CUDA); on the CPU the tensor itself and no event."""
    if stats.device.type != "cuda":
        return stats, None
    host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
    host.copy_(stats, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


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


class OptimizerWrapper:
    """Shared logic of `MixedPrecisionOptimizer` and `FP32Optimizer` (see the module docstring).

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
        fold_into_fused_step: use the folded step (module docstring) when it applies.
        flat_adam_step: the folded step's update as one fused pass over flat buffers where it applies
            (`mptrain.precision.flat_adam`; compiled on CUDA, eager elsewhere); False: torch's fused Adam
            kernel, then the model-param copy.
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
        flat_adam_step: bool = False,
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
        self.flat_step: Optional[FlatAdamStep] = None
        self.flat_step_note = self._build_flat_step(flat_adam_step, grad_fn)

    def _build_flat_step(self, wanted: bool, grad_fn) -> str:
        """Build `flat_step` where ``flat_adam_step`` asks for it and it applies; the start-up log's note."""
        if not wanted:
            return "off (precision.flat_adam_step=false)"
        reason = why_not_flat(self.entries, self.optimizer, grad_fn) if self.folded_step else \
            "no folded step (a loss scaler, or not torch's fused Adam / AdamW)"
        if reason is not None:
            logger.warning("precision.flat_adam_step=true does not apply (%s): torch's kernel steps", reason)
            return f"off ({reason})"
        self.flat_step = FlatAdamStep(self.entries, self.optimizer, grad_fn)
        return f"on ({len(self.flat_step.buffers)} buffer(s))"

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

    @torch.no_grad()
    def _copy_model_params_to_main_params(self) -> None:
        pairs = [(e.model_param, e.main) for e in self.entries if e.has_copy]
        if pairs:
            torch._foreach_copy_([w for _, w in pairs], [m for m, _ in pairs])

    def _grad_stats_groups(self) -> list:
        return [self.groups.mp_group]

    # --- derived lists ------------------------------------------------------------------
    def _main_grads(self) -> list:
        return [e.main.grad for e in self.entries if e.main.grad is not None]

    def _main_grads_for_norm(self) -> list:
        tp_rank = self.groups.tp_rank
        return [e.main.grad for e in self.entries if e.main.grad is not None and e.spec.counts_on(tp_rank)]

    # --- public interface ---------------------------------------------------------------
    @property
    def param_groups(self) -> list:
        """The inner optimizer's param groups (the LR scheduler writes ``lr`` here)."""
        return self.optimizer.param_groups

    def main_params(self) -> list:
        """The fp32 params the inner optimizer steps, in entry order."""
        return [e.main for e in self.entries]

    def main_param_map(self) -> dict:
        """{model param: fp32 main param} (the same tensor for fp32 params)."""
        return {e.model_param: e.main for e in self.entries}

    def get_loss_scale(self) -> float:
        """The loss scale S to multiply the loss by before backward (1.0 without a scaler)."""
        return 1.0 if self.scaler is None else float(self.scaler.scale.item())

    def reload_model_params(self) -> None:
        """Re-copy the model params into the main params (after loading model weights)."""
        self._copy_model_params_to_main_params()

    def zero_grad(self) -> None:
        """Drop the main grads and the model params' ``.grad`` (the DP buffer is zeroed by the DDP wrapper)."""
        for e in self.entries:
            e.main.grad = None
            e.model_param.grad = None

    def _found_non_finite(self, main_grads: list, grad_scale: Optional[torch.Tensor] = None) -> bool:
        device = main_grads[0].device if main_grads else self.groups.device
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if main_grads:
            inv_scale = (torch.ones(1) if self.scaler is None else self.scaler.inv_scale).to(device)
            if grad_scale is not None:  # folded in: one pass over the grads instead of two
                inv_scale = (inv_scale.double() * grad_scale.to(device).reshape(1)).float()
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found_inf, inv_scale)
        all_reduce_over(found_inf, self._grad_stats_groups(), dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)  # host sync, once per step

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
        return StepResult(update_successful=False, grad_norm=None, num_zeros=None, found_inf=True)

    @torch.no_grad()
    def step(self, grad_scale: Optional[torch.Tensor] = None, read_along: Optional[torch.Tensor] = None) -> StepResult:
        """One optimizer step (module docstring, steps 1-5). Collective over the grad-stats groups.

        Args:
            grad_scale: an extra factor for every grad (0-d tensor, e.g. `finalize.token_scale`),
                multiplied in by the unscale pass of step 2 (None = 1).
            read_along: a small tensor the caller wants on the host (the trainer's loss totals):
                read together with the step's own host read (the folded step's norm), so that an
                iteration syncs once; returned as ``StepResult.read_along`` (a tuple of floats).

        Returns:
            `StepResult`; ``update_successful`` False (and no param changed) on non-finite grads.
        Raises:
            TooManySkippedStepsError: more than ``max_consecutive_skips`` skipped steps in a row.
        """
        return self.launch_step(grad_scale, read_along).result()

    @torch.no_grad()
    def launch_step(self, grad_scale: Optional[torch.Tensor] = None,
                    read_along: Optional[torch.Tensor] = None) -> PendingStep:
        """`step` without waiting for its outcome where the skip decision can stay on the device
        (the folded step); the other paths settle on the host here. Same arguments as `step`.

        Returns:
            a `PendingStep`; its ``result()`` is `step`'s `StepResult`. Settle it before the next
            step (the trainer does, after the next forward-backward is enqueued).
        """
        if self.folded_step:
            return self._launch_folded(grad_scale, read_along)
        return PendingStep.settled(self._step_on_host(grad_scale, read_along))

    def _step_on_host(self, grad_scale: Optional[torch.Tensor], read_along: Optional[torch.Tensor]) -> StepResult:
        """Steps 1-5 of the module docstring, deciding on the host (a loss scaler; a non-fused inner optimizer)."""
        self._copy_model_grads_to_main_grads()
        main_grads = self._main_grads()
        found_inf = self._found_non_finite(main_grads, grad_scale)
        # the scaler's path syncs on found_inf already; the values were enqueued before it, so no wait
        along = None if read_along is None else tuple(read_along.reshape(-1).tolist())
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            return dataclasses.replace(self._skip(), read_along=along)
        stats_groups = self._grad_stats_groups()
        norm_grads = self._main_grads_for_norm()
        total_norm = get_grad_norm_fp32(norm_grads, stats_groups, device=self.groups.device)
        if self.clip_grad > 0:
            clip_grads_by_total_norm(main_grads, self.clip_grad, total_norm)
        num_zeros = self._count_zeros(stats_groups)
        self.optimizer.step()
        return dataclasses.replace(self._applied(float(total_norm.item()), num_zeros), read_along=along)

    def _count_zeros(self, stats_groups: list) -> Optional[int]:
        """Zero elements of the counted main grads over the grad-stats groups (``log_num_zeros``), else None."""
        if not self.log_num_zeros:
            return None
        return int(count_zeros_fp32(self._main_grads_for_norm(), stats_groups, device=self.groups.device).item())

    def _applied(self, grad_norm: float, num_zeros: Optional[int]) -> StepResult:
        """After the inner step: write the main params back into the model params; the step's result."""
        self._copy_main_params_to_model_params()
        self.consecutive_skips = 0
        return StepResult(update_successful=True, grad_norm=grad_norm, num_zeros=num_zeros, found_inf=False)

    def _counted_mask(self, counted: tuple, device: torch.device) -> torch.Tensor:
        """The 0/1 float mask of `counted` on `device`, built once: a fresh host-to-device copy each
        step would be a pageable, synchronising copy in the middle of the step."""
        key = (counted, str(device))
        if key not in self._counted_masks:
            self._counted_masks[key] = torch.tensor(counted, dtype=torch.float32, device=device)
        return self._counted_masks[key]

    def _launch_folded(self, grad_scale: Optional[torch.Tensor], read_along: Optional[torch.Tensor]) -> PendingStep:
        """`launch_step` with the unscale and clip passes folded into the fused Adam kernel and the skip
        decision on the device (module docstring); nothing here waits for the host."""
        self._copy_model_grads_to_main_grads()
        stats_groups = self._grad_stats_groups()
        tp_rank = self.groups.tp_rank
        pairs = [(e.main.grad, e.spec.counts_on(tp_rank)) for e in self.entries if e.main.grad is not None]
        device = pairs[0][0].device if pairs else self.groups.device
        total_norm, non_finite = get_grad_norm_and_non_finite_count_fp32(
            [g for g, _ in pairs], self._counted_mask(tuple(c for _, c in pairs), device), stats_groups, device=device)
        divisor = torch.ones((), dtype=torch.float32, device=total_norm.device)
        if grad_scale is not None:
            factor = grad_scale.to(device=total_norm.device, dtype=torch.float32).reshape(())
            total_norm, divisor = total_norm * factor, divisor / factor
        # of the raw grads: a finite non-zero factor keeps zeros zero
        zeros = (count_zeros_fp32(self._main_grads_for_norm(), stats_groups, device=device).double()
                 if self.log_num_zeros else torch.full((), math.nan, dtype=torch.float64, device=device))
        parts = [total_norm.double().reshape(1), non_finite.double().reshape(1), zeros.reshape(1).to(device)]
        if read_along is not None:  # float32 -> float64 is exact: the same Python floats
            parts.append(read_along.reshape(-1).to(device=device, dtype=torch.float64))
        stats, ready = _to_host_async(torch.cat(parts))
        # the same decision on every rank (the stats were all-reduced); 1.0 makes the kernel return untouched
        found_inf = ((non_finite > 0) | ~torch.isfinite(total_norm)).float().reshape(())
        if self.clip_grad > 0:  # as clip_grads_by_total_norm: coef = clip / (norm + 1e-6), at most 1
            divisor = divisor / (self.clip_grad / (total_norm + 1e-6)).clamp(max=1.0)
        why_not = None if self.flat_step is None else self.flat_step.why_not_now()
        if why_not is not None:  # the params and state stay valid views: torch's kernel steps them as they are
            logger.warning("precision.flat_adam_step: %s; torch's kernel steps from now on", why_not)
            self.flat_step = None
        if self.flat_step is not None:
            self.flat_step.step(divisor, found_inf)  # the same update, the model params written in the pass
            return PendingStep(self, stats, ready, has_along=read_along is not None)
        # torch's fused Adam divides each grad by grad_scale in the kernel and skips the update on found_inf
        self.optimizer.grad_scale, self.optimizer.found_inf = divisor, found_inf
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf
        self._copy_main_params_to_model_params()  # after a skipped update: the values they already hold
        return PendingStep(self, stats, ready, has_along=read_along is not None)

    def _settle(self, norm: float, non_finite: float, num_zeros: Optional[int], along: Optional[tuple]) -> StepResult:
        """The host's side of a folded step once its statistics are read: skip counters, the skip limit."""
        if non_finite > 0 or not math.isfinite(norm):  # the decision the kernel took from found_inf
            return dataclasses.replace(self._skip(), read_along=along)
        self.consecutive_skips = 0
        return StepResult(update_successful=True, grad_norm=norm, num_zeros=num_zeros, found_inf=False,
                          read_along=along)

    # --- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"optimizer": inner state, "main_params": [fp32 copies, entry order], "scaler", "counters"}."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "main_params": [e.main.detach().clone() for e in self.entries if e.has_copy],
            **self._scaler_and_counters_state(),
        }

    def _scaler_and_counters_state(self) -> dict:
        """{"scaler", "counters"}: the part of the state every wrapper (ZeRO-1 included) saves alike."""
        return {
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "counters": {
                "skipped_iters_total": self.skipped_iters_total,
                "nan_iters_total": self.nan_iters_total,
                "consecutive_skips": self.consecutive_skips,
            },
        }

    def _load_scaler_and_counters(self, state_dict: dict) -> None:
        if self.scaler is not None:
            if state_dict.get("scaler") is None:
                logger.warning("optimizer state has no loss scaler state; keeping the scaler's initial state")
            else:
                self.scaler.load_state_dict(state_dict["scaler"])
        counters = state_dict.get("counters", {})
        self.skipped_iters_total = int(counters.get("skipped_iters_total", 0))
        self.nan_iters_total = int(counters.get("nan_iters_total", 0))
        self.consecutive_skips = int(counters.get("consecutive_skips", 0))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict` saved (model params are loaded separately and not touched).

        Raises:
            ValueError: the number or shapes of main params differ from this optimizer's.
        """
        copies = [e.main for e in self.entries if e.has_copy]
        saved = state_dict["main_params"]
        if len(saved) != len(copies):
            raise ValueError(f"{type(self).__name__}.load_state_dict: {len(saved)} saved main params, expected {len(copies)}")
        for main, value in zip(copies, saved):
            if tuple(value.shape) != tuple(main.shape):
                raise ValueError(f"main param shape {tuple(value.shape)} in the state dict, expected {tuple(main.shape)}")
            main.copy_(value)
        self.optimizer.load_state_dict(state_dict["optimizer"])  # a flat step re-binds at its next step
        self._load_scaler_and_counters(state_dict)


class MixedPrecisionOptimizer(OptimizerWrapper):
    """fp32 main copies of fp16/bf16 model params (Megatron `Float16OptimizerWithFloat16Params`).

    fp32 model params (if any) are stepped in place, as Megatron's ``fp32_from_fp32_groups``.
    Same arguments as `OptimizerWrapper`.
    """

    def _make_main_param(self, param, spec):
        if param.dtype in _HALF:
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
    "optimizer wrapper", methods=("step", "zero_grad", "state_dict", "load_state_dict", "get_loss_scale",
                                  "reload_model_params"),
    interface=OptimizerWrapper)
_BUILTIN_WRAPPERS = (FP32Optimizer, MixedPrecisionOptimizer)


def wrapper_target(precision_cfg, use_distributed_optimizer: bool):
    """The wrapper class that runs, the one rule: ``precision._target_``, except that with
    ``parallel.use_distributed_optimizer=true`` a built-in wrapper (FP32Optimizer / MixedPrecisionOptimizer)
    is replaced by `mptrain.distributed.DistributedOptimizer` (ZeRO-1 shards fp32 main params of any
    params dtype); a user wrapper must then itself be a DistributedOptimizer subclass.

    Raises:
        ConfigError: the target does not import or lacks a method; a user wrapper that cannot shard
            with use_distributed_optimizer=true.
    """
    from mptrain.distributed.distrib_optimizer import DistributedOptimizer  # noqa: PLC0415 - it imports this module

    target, _ = resolve("precision", {"_target_": precision_cfg._target_}, OPTIMIZER_WRAPPER)
    if not use_distributed_optimizer:
        return target
    if target in _BUILTIN_WRAPPERS:
        return DistributedOptimizer
    if isinstance(target, type) and issubclass(target, DistributedOptimizer):
        return target
    raise ConfigError(f"precision._target_={precision_cfg._target_} is not a DistributedOptimizer, but "
                      "parallel.use_distributed_optimizer=true shards the optimizer; subclass "
                      "mptrain.distributed.DistributedOptimizer or set parallel.use_distributed_optimizer=false")


def build_optimizer_wrapper(precision_cfg, *, use_distributed_optimizer: bool, build_optimizer, model_chunks: list,
                            groups, scaler, clip_grad: float, max_consecutive_skips: int):
    """The optimizer wrapper over this rank's DDP ``model_chunks`` (the one place it is built).

    The runtime offers ``build_optimizer`` (param groups -> inner optimizer), the flat ``params`` /
    ``specs`` / ``grad_fn`` (the DDP main grad of each param), ``model_chunks``, ``groups``, ``scaler``,
    ``clip_grad``, ``max_consecutive_skips``; a wrapper gets those its signature takes (FP32Optimizer
    and MixedPrecisionOptimizer the flat lists, DistributedOptimizer the chunks).
    """
    params, specs, owner = [], [], {}
    for chunk in model_chunks:
        for name, param in chunk.module.named_parameters():
            params.append(param)
            specs.append(chunk.specs[name])
            owner[param] = chunk
    target = wrapper_target(precision_cfg, use_distributed_optimizer)
    flat = bool(getattr(precision_cfg, "flat_adam_step", False))
    if flat and "flat_adam_step" not in (accepted_keywords(target) or {"flat_adam_step"}):
        logger.warning("precision.flat_adam_step=true is ignored: the optimizer wrapper %s does not take it",
                       getattr(target, "__name__", target))
    node = {"_target_": target, **extra_keys(precision_cfg)}
    offered = dict(build_optimizer=build_optimizer, params=params, specs=specs, grad_fn=lambda p: owner[p].main_grad(p),
                   model_chunks=list(model_chunks), groups=groups, scaler=scaler, clip_grad=clip_grad,
                   max_consecutive_skips=max_consecutive_skips,
                   flat_adam_step=flat)
    return build("precision", node, OPTIMIZER_WRAPPER, mapped=offered, partial=False)
