"""Flat Adam / AdamW step (opt-in, ``precision.flat_adam_step=true``): one fused pass per contiguous grad
buffer updates the fp32 main params and their moments and writes the half-precision model params.

Why: torch's fused AdamW is a multi-tensor kernel over one tensor per param that, given a
``grad_scale``, also writes the unscaled grads back; the fp32 → bf16 model-param copy is a second
pass. Per element that is 32 bytes (read param, grad, exp_avg, exp_avg_sq; write them back) plus 6
for the copy. Here the main params, the moments and the model params are views of flat buffers laid
out like the DDP grad buffer (`mptrain.distributed.grad_buffer.GradBuffer`: the same element offsets),
so one elementwise pass reads param, grad, exp_avg, exp_avg_sq and a 1-byte param-group index and
writes param, exp_avg, exp_avg_sq and the model param: 31 bytes, one launch per buffer (gpt_1.3b:
12.7 + 2.2 ms of torch kernels per step on an H200, BENCHMARKS.md "GPU round 6"). Megatron's
counterpart is TransformerEngine's ``FusedAdam(master_weights=True)`` (``--use-precision-aware-optimizer``).

Layout (one `FlatBuffer` per grad storage; ``N`` its elements, offsets those of the grad buffer)::

    grad        [N] fp32 (or the params' dtype)   the DDP buffer itself, read as is
    main        [N] fp32       main params = views ``main[start:end].view(shape)``
    model       [N] bf16/fp16  model params = views (their ``.data`` is rebound once, at construction)
    exp_avg     [N] fp32       torch's ``state[main]["exp_avg"]`` = views (checkpoints see torch's state)
    exp_avg_sq  [N] fp32       likewise
    group       [N] uint8      index of the param group (lr, weight decay) of each element

Elements of the buffer outside every param (DDP padding) hold zeros everywhere and stay zero.

Arithmetic: `flat_adam_math` follows the formula of torch's CUDA fused Adam as its source reads
(``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, ``adam_math`` and ``FusedAdamMathFunctor``): fp32
values, the scalar products that source forms in double (lr, betas, eps, weight decay, the grad divisor,
the bias corrections, rounded to float32 where it passes them on) formed in float64 too. On
CUDA it is compiled (`torch.compile`, one Triton kernel per buffer); elsewhere it runs eagerly (the
tests' path). It is not bitwise torch's kernel: on an H200 with torch 2.11 (BENCHMARKS.md "GPU round
7") half the main-param elements differed after 3 steps (at most 2.2e-8 absolute, 1e-4 of a step) and
exp_avg_sq by up to 220 ulps (1.29e-5 relative, exactly the float32 rounding of 1 - 0.999: a lead
that torch 2.11's kernel forms its scalars in float32). Hence off by default.

The per-param ``step`` counts stay torch's (one float32 tensor per param, +1 per applied step, as
``torch._fused_adamw_``); the kernel reads the first one (all are equal: every param steps together).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

def flat_adam_math(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   model_param: torch.Tensor, group: torch.Tensor, hyper: torch.Tensor, consts: torch.Tensor,
                   step: torch.Tensor, divisor: torch.Tensor, found_inf: torch.Tensor, decoupled: bool,
                   div_through_f64: bool = False) -> None:
    """One Adam / AdamW update of flat buffers, in place.

    Args:
        param: fp32 ``[N]`` main params (updated).
        grad: ``[N]`` grads, fp32 or half (read; divided by ``divisor``).
        exp_avg, exp_avg_sq: fp32 ``[N]`` moments (updated).
        model_param: half ``[N]`` model params (written: the new main params rounded to nearest).
        group: uint8 ``[N]``: each element's row of ``hyper``.
        hyper: float64 ``[G, 2]``: (lr, weight_decay) per param group.
        consts: float64 ``[5]``: beta1, beta2, 1 - beta1, 1 - beta2, eps, formed on the host in double
            (torch's source takes them as doubles).
        step: float32 0-d: the step count after this step's increment (bias corrections).
        divisor: float32 0-d: every grad is divided by it (1 / (grad scale × clip coefficient), torch's
            ``grad_scale``).
        found_inf: float32 0-d, 1.0 = leave everything as it is (torch's ``found_inf``).
        decoupled: AdamW's decay (``param -= lr·wd·param``) instead of Adam's L2 term (``grad += wd·param``).
        div_through_f64: form the two float32 quotients in float64 (correctly rounded, slower), for a
            compiler whose float32 '/' is approximate and cannot be told otherwise (`_compile_options`).
    """
    lr, wd = hyper[:, 0], hyper[:, 1]
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps = consts[0], consts[1], consts[2], consts[3], consts[4]
    s = step.double()
    bias_correction1 = (1 - beta1 ** s).float()
    step_size = (lr / bias_correction1.double()).float()  # [G]
    bias_correction2_sqrt = torch.sqrt(1 - beta2 ** s).float()  # sqrt in double, then float (torch >= 2.4's source)
    g = (grad.float().double() / divisor.double()).float()
    p = param
    if decoupled:
        p = (p.double() - _per_element(lr * wd, group) * p.double()).float()
    else:
        g = (g.double() + p.double() * _per_element(wd, group)).float()
    g64 = g.double()
    m = (beta1 * exp_avg.double() + one_minus_beta1 * g64).float()
    v = (beta2 * exp_avg_sq.double() + one_minus_beta2 * g64 * g64).float()
    denom = (_div(torch.sqrt(v), bias_correction2_sqrt, div_through_f64).double() + eps).float()
    p = p - _div(_per_element(step_size, group) * m, denom, div_through_f64)
    keep = found_inf > 0
    p = torch.where(keep, param, p)
    exp_avg.copy_(torch.where(keep, exp_avg, m))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, v))
    param.copy_(p)
    model_param.copy_(p.to(model_param.dtype))


def _div(x: torch.Tensor, y: torch.Tensor, through_f64: bool) -> torch.Tensor:
    """float32 ``x / y`` as IEEE division; through float64 when asked (53 >= 2·24 + 2 bits: no double rounding)."""
    return (x.double() / y.double()).float() if through_f64 else x / y


def _compile_options() -> tuple[dict, bool]:
    """Inductor options for the kernel, and whether the quotients must go through float64.

    torch's kernel divides in IEEE float32, Triton's '/' is the approximate ``div.full``: Inductor's
    eager-division option makes it ``div_rn`` (its name differs between torch releases). One kernel
    config, no benchmarking of several: that would clone every mutated buffer once (14 bytes per element
    on top of the model's memory)."""
    from torch._inductor import config  # noqa: PLC0415 - CUDA only

    options = {"triton.autotune_pointwise": False}
    if hasattr(config, "emulate_precision_casts"):
        options["emulate_precision_casts"] = True
    if hasattr(getattr(config, "eager_numerics", None), "division_rounding"):
        return {**options, "eager_numerics.division_rounding": True}, False
    if hasattr(config, "emulate_divison_rounding"):  # sic: torch 2.10's spelling
        return {**options, "emulate_divison_rounding": True}, False
    return options, True


def _per_element(table: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``table[group]`` for a short ``[G]`` table, as a chain of selects (G is 2 for the decay / no-decay
    groups): no gather and no index bounds check in the compiled kernel."""
    out = table[0]
    for i in range(1, table.shape[0]):
        out = torch.where(group == i, table[i], out)
    return out if out.dim() else out.expand(group.shape)


def _kernel(device_type: str) -> tuple[Callable, bool]:
    """(`flat_adam_math`, its ``div_through_f64``): compiled on CUDA (one fused kernel per buffer shape; Dynamo
    caches the graph by the function's code, so every `FlatAdamStep` shares it), eager elsewhere."""
    if device_type != "cuda":
        return flat_adam_math, False
    options, through_f64 = _compile_options()
    return torch.compile(flat_adam_math, fullgraph=True, dynamic=False, options=options), through_f64


@dataclasses.dataclass
class FlatBuffer:
    """The flat tensors of one grad storage (module docstring) and the entries that live in it."""

    grad: torch.Tensor
    main: torch.Tensor
    model: torch.Tensor
    group: torch.Tensor
    slots: list  # [(entry, start, end)]
    exp_avg: Optional[torch.Tensor] = None  # made at the first step (as torch's state): not at construction,
    exp_avg_sq: Optional[torch.Tensor] = None  # while the params' old storage is still alive


def _share_betas_and_eps(groups: list) -> bool:
    """One (betas, eps) for every param group: the kernel takes them as scalars, not per group."""
    return len({(tuple(g["betas"]), g["eps"]) for g in groups}) == 1


def why_not_flat(entries: list, optimizer, grad_fn: Callable) -> Optional[str]:
    """None when the flat step applies to these entries and inner optimizer, else the reason (a phrase).

    It applies to torch.optim.Adam / AdamW (fused, no amsgrad / maximize, one betas and eps) over fp32
    main copies of half model params whose grads are contiguous views of shared buffers.
    """
    from mptrain.precision.optimizer import _HALF, MainParamEntry  # noqa: PLC0415 - it imports this module

    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not optimizer.defaults.get("fused"):
        return "the inner optimizer is not torch's fused Adam / AdamW"
    groups = optimizer.param_groups
    if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in groups):
        return "amsgrad / maximize / differentiable"
    if not _share_betas_and_eps(groups):
        return "param groups with different betas or eps"
    if len(groups) > 255:
        return "more than 255 param groups"
    if not entries:
        return "no params"
    for e in entries:
        if type(e) is not MainParamEntry or not e.has_copy or e.model_param.dtype not in _HALF:
            return "not every param is a half-precision param with an fp32 main copy"
        grad = grad_fn(e.model_param)
        if grad is None or not grad.is_contiguous() or grad.shape != e.model_param.shape:
            return "a grad is not a contiguous view of a grad buffer"
    return None


class FlatAdamStep:
    """The flat step over ``entries`` (`MainParamEntry` list of an `OptimizerWrapper`); see the module
    docstring. Construction moves the main and model params into the flat buffers (rebinding their
    ``.data``; values unchanged) and must come before the model's first forward.

    It replaces the inner optimizer's ``step()`` and the wrapper's ``_copy_main_params_to_model_params``:
    torch's optimizer step hooks do not run, and a subclass overriding that copy should keep it off. The
    params being views, ``torch.save`` of one of them alone writes its whole buffer (checkpoints save
    by param and are unaffected). On the CPU it runs eagerly, with float64 temporaries over the whole
    buffer: far slower than torch's fused CPU kernel, meant for tests.

    Args:
        entries: the wrapper's entries (`why_not_flat` must have returned None for them).
        optimizer: the inner torch Adam / AdamW over the entries' main params.
        grad_fn: ``model param -> grad view`` (the DDP main_grad), the same views every step.
    Raises:
        ValueError: two params' grads overlap in a buffer, or a buffer mixes model-param dtypes.
    """

    def __init__(self, entries: list, optimizer, grad_fn: Callable) -> None:
        self.optimizer = optimizer
        self.entries = list(entries)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        by_storage: dict = {}
        for e in self.entries:
            grad = grad_fn(e.model_param)
            key = grad.untyped_storage().data_ptr()
            by_storage.setdefault(key, (grad, []))[1].append((e, grad.storage_offset(), grad.numel(), grad.data_ptr()))
        self.buffers: list[FlatBuffer] = []
        for grad, items in by_storage.values():
            n = grad.untyped_storage().nbytes() // grad.element_size()
            self.buffers.append(self._build_buffer(grad.as_strided((n,), (1,), 0), items, group_of))
        # per entry: the addresses of its grad, main and model param views, checked each step (`why_not_now`)
        self._grad_ptrs = [(e, ptr) for _, items in by_storage.values() for e, _, _, ptr in items]
        self._param_ptrs = [(e, e.main.data_ptr(), e.model_param.data_ptr()) for e in self.entries]
        self._grad_fn = grad_fn
        device = self.buffers[0].main.device
        self.device = device
        # per step: [lr, weight_decay] per group, then beta1, beta2, 1 - beta1, 1 - beta2, eps (`_upload_scalars`)
        n_scalars = 2 * len(optimizer.param_groups) + 5
        self._scalars = torch.zeros(n_scalars, dtype=torch.float64, device=device)
        self._scalars_host = torch.zeros(n_scalars, dtype=torch.float64, pin_memory=device.type == "cuda")
        self._scalars_copied = None  # CUDA event after the last host-to-device copy of _scalars_host
        self._kernel, self._div_through_f64 = _kernel(device.type)
        self._probe = None  # (main param, its exp_avg view) once bound: see `state_is_bound`

    @staticmethod
    def _build_buffer(grad: torch.Tensor, items: list, group_of: dict) -> FlatBuffer:
        n, device = grad.numel(), grad.device
        dtypes = {e.model_param.dtype for e, *_ in items}
        if len(dtypes) != 1:
            raise ValueError(f"FlatAdamStep: one grad buffer holds params of dtypes {sorted(map(str, dtypes))}")
        buf = FlatBuffer(grad=grad, main=torch.zeros(n, dtype=torch.float32, device=device),
                         model=torch.zeros(n, dtype=dtypes.pop(), device=device),
                         group=torch.zeros(n, dtype=torch.uint8, device=device), slots=[])
        end_before = -1
        for e, start, numel, _ in sorted(items, key=lambda it: it[1]):
            if start < end_before:
                raise ValueError("FlatAdamStep: two params' grads overlap in one grad buffer")
            end = end_before = start + numel
            shape = e.model_param.shape
            with torch.no_grad():
                buf.main[start:end].copy_(e.main.detach().reshape(-1))
                buf.model[start:end].copy_(e.model_param.detach().reshape(-1))
                buf.group[start:end] = group_of[id(e.main)]
            e.main.data = buf.main[start:end].view(shape)  # the same Parameter objects, now views
            e.model_param.data = buf.model[start:end].view(shape)
            buf.slots.append((e, start, end))
        return buf

    def why_not_now(self) -> Optional[str]:
        """None while the layout and the scalars it was built for still hold, else why not (a phrase):
        every grad is still the view it was laid out on (grad_fn's contract), every main and model param
        still a view of its buffer (not re-assigned ``.data``: ``model.to(...)``, a user re-init), and
        the param groups still share one betas / eps."""
        if not all(self._grad_fn(e.model_param).data_ptr() == ptr for e, ptr in self._grad_ptrs):
            return "the grads are no longer the views the flat buffers were laid out on"
        if not all(e.main.data_ptr() == main and e.model_param.data_ptr() == model for e, main, model in self._param_ptrs):
            return "a param's .data was replaced after the flat buffers were laid out"
        if not _share_betas_and_eps(self.optimizer.param_groups):
            return "the param groups no longer share one betas / eps"
        return None

    @torch.no_grad()
    def bind_state(self) -> None:
        """Point torch's per-param state at the flat moments: fresh (zeros, step 0) when the state is
        empty, else the loaded values copied in (after ``optimizer.load_state_dict``).

        Raises:
            ValueError: the loaded step counts differ between params (the kernel uses one).
        """
        steps = set()
        for buf in self.buffers:
            if buf.exp_avg is None:
                buf.exp_avg = torch.zeros_like(buf.main)
                buf.exp_avg_sq = torch.zeros_like(buf.main)
            for e, start, end in buf.slots:
                state = self.optimizer.state[e.main]
                for key, flat in (("exp_avg", buf.exp_avg), ("exp_avg_sq", buf.exp_avg_sq)):
                    view = flat[start:end].view(e.main.shape)
                    if key not in state:
                        view.zero_()  # fresh (also after a state cleared later: no stale moments)
                    elif state[key] is not view:
                        view.copy_(state[key])
                    state[key] = view
                # a tensor of our own: a loaded state dict may share its step tensors with another optimizer
                step = float(state.get("step", 0.0))
                state["step"] = torch.tensor(step, dtype=torch.float32, device=self.device)
                steps.add(step)
        if len(steps) > 1:
            raise ValueError(f"FlatAdamStep: the params' Adam step counts differ ({sorted(steps)}); "
                             "set precision.flat_adam_step=false")
        main = self.buffers[0].slots[0][0].main
        self._probe = (main, self.optimizer.state[main]["exp_avg"])

    def state_is_bound(self) -> bool:
        """Whether torch's state still holds the flat views. ``Optimizer.load_state_dict`` (a checkpoint
        resume, from anywhere) replaces every state tensor, so one probe tells."""
        if self._probe is None:
            return False
        main, view = self._probe
        return self.optimizer.state.get(main, {}).get("exp_avg") is view

    def _upload_scalars(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's scalars on the device without waiting for it (the LR schedule writes a float ``lr``
        each step; betas / eps are read each step too): pinned staging, asynchronous copy.

        Returns:
            (hyper float64 ``[G, 2]`` (lr, weight_decay) per group, consts float64 ``[5]``).
        """
        if self._scalars_copied is not None:
            self._scalars_copied.synchronize()  # the copy of the previous step (long done) before reuse
        groups = self.optimizer.param_groups
        (beta1, beta2), eps = groups[0]["betas"], groups[0]["eps"]
        beta1, beta2 = float(beta1), float(beta2)  # 1 - beta formed here, in double, as torch's source
        values = [v for g in groups for v in (float(g["lr"]), float(g.get("weight_decay", 0.0)))]
        self._scalars_host.copy_(torch.tensor(values + [beta1, beta2, 1 - beta1, 1 - beta2, float(eps)],
                                              dtype=torch.float64))
        self._scalars.copy_(self._scalars_host, non_blocking=True)
        if self.device.type == "cuda":
            self._scalars_copied = torch.cuda.Event()
            self._scalars_copied.record()
        n = 2 * len(groups)
        return self._scalars[:n].view(len(groups), 2), self._scalars[n:]

    @torch.no_grad()
    def step(self, divisor: torch.Tensor, found_inf: torch.Tensor) -> None:
        """The update of every buffer (module docstring), enqueued without a host sync.

        Args:
            divisor: float32 0-d on the device, every grad is divided by it.
            found_inf: float32 0-d on the device; 1.0 leaves params, moments and step counts unchanged.
        """
        if not self.state_is_bound():
            self.bind_state()
        steps = [self.optimizer.state[e.main]["step"] for e in self.entries]
        torch._foreach_add_(steps, 1.0 - found_inf)  # torch: +1, then -found_inf
        hyper, consts = self._upload_scalars()
        group = self.optimizer.param_groups[0]
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)))
        for buf in self.buffers:
            self._kernel(buf.main, buf.grad, buf.exp_avg, buf.exp_avg_sq, buf.model, buf.group, hyper, consts,
                         steps[0], divisor, found_inf, decoupled, self._div_through_f64)
