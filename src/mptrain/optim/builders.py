"""The optimizer component: built from ``optim._target_`` with the param groups the runtime passes.

The optimizer wrappers (`mptrain.precision.optimizer`) own the fp32 main params; they call the
factory returned by `build_optimizer_factory` with the param groups of those main params. The
factory builds ``optim._target_`` through `mptrain.components.build`:

- keywords: the Megatron keys mapped onto the target's keywords where its signature takes them
  (``lr``, ``weight_decay``, ``betas`` = (adam_beta1, adam_beta2), ``eps`` = adam_eps,
  ``momentum`` = sgd_momentum), plus the keys a user added (``+optim.alpha=0.95`` for
  torch.optim.RMSprop), which win;
- kernel (``optim.impl``): ``auto`` / ``torch``: ``fused=True`` (torch's fused kernels, CUDA and CPU,
  where the tests run the same folded step as the GPU: `mptrain.precision.optimizer`) when every
  param is on one CUDA or CPU device type and the target takes ``fused``, else ``foreach=True``
  (multi-tensor) if it takes that; ``apex``: apex ``FusedAdam`` / ``FusedSGD`` when the target is
  torch.optim.Adam / AdamW / SGD (`APEX_KERNELS`, keyed on the imported class) and apex is
  importable, else a ConfigError.

Weight decay (Megatron `get_param_groups`): biases and norm params (``ShardSpec.no_weight_decay``)
go into a group with weight_decay 0; the other group takes ``optim.weight_decay`` (as the
optimizer default, so that `param_groups` needs no config). The input embedding and the output layer
(``ShardSpec.embedding_or_output``) get groups of their own, which the LR schedule drives by
``optim.decoupled_lr`` when set (`EMBEDDING_OR_OUTPUT`). ``adam`` is torch's Adam (L2 penalty
added to the grad); ``adamw`` decouples the decay (Loshchilov & Hutter 2019) — Megatron's
``--optimizer adam`` is the decoupled one, i.e. our ``adamw``.

`check_optimizer` (called by `validate_config`) is the start-up check: value ranges, ``impl``, the
component checks, and a throwaway instance on a 1-element tensor (an optimizer rejecting its
arguments is one ConfigError line before any collective).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import torch

from mptrain import components
from mptrain.errors import ConfigError

IMPLS = ("auto", "torch", "apex")


@runtime_checkable
class Optimizer(Protocol):
    """The inner optimizer interface (torch.optim.Optimizer's): what the wrappers and checkpoints use.

    - constructor: ``cls(params, **keywords)``; ``params`` = [{"params": [fp32 main params],
      ("weight_decay": float)}, ...] (a decayed and a no-decay group, always both; two more marked
      ``embedding_or_output`` where the embedding or output layer is held: `param_groups`);
    - ``param_groups``: those dicts; the LR schedule writes ``group["lr"]`` (a float, per step) there;
    - ``step()`` updates the params from their ``.grad`` (fp32, already unscaled and clipped);
    - ``state``: {param: {name: tensor | scalar}}: tensors of the param's shape are checkpointed by
      global offsets (resharded with the param), anything else as an object;
    - ``zero_grad()``, ``state_dict()``, ``load_state_dict(sd)`` as torch.
    """

    param_groups: list

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


OPTIMIZER = components.ComponentKind(
    "optimizer", methods=("step", "zero_grad", "state_dict", "load_state_dict"), runtime_keywords=("params",),
    interface=Optimizer)

EMBEDDING_OR_OUTPUT = "embedding_or_output"
"""The param-group key (True) of the groups that hold the embedding and output layer (`param_groups`): the LR
schedule gives them ``optim.decoupled_lr`` / ``optim.decoupled_min_lr`` when set (`mptrain.optim.lr_scheduler`)."""


def param_groups(params: Sequence[torch.nn.Parameter], specs: Sequence, weight_decay: Optional[float] = None) -> list[dict]:
    """Split params into a decayed and a non-decayed group (always both, possibly empty, in that order), and the
    input embedding / output layer (``spec.embedding_or_output``) into two more groups of the same kinds.

    Megatron's ``_get_param_groups`` (megatron/core/optimizer/__init__.py) keys its groups by weight decay and by
    ``is_embedding_or_output_parameter`` where ``--decoupled-lr`` is set; here the embedding / output groups exist
    whenever such params do, so that the groups need no config: the LR schedule alone decides whether they run
    on ``optim.decoupled_lr`` or on ``optim.lr`` (with it unset they carry the same hyperparameters as the first
    two, so the split changes no update).

    Args:
        params: parameters (model or fp32 main params), in a stable order.
        specs: one `ShardSpec` per param; ``spec.no_weight_decay`` selects the non-decayed kind,
            ``spec.embedding_or_output`` the embedding / output groups.
        weight_decay: decay of the decayed groups; None leaves the key out, so the optimizer default
            (``optim.weight_decay`` from `build_optimizer_factory`) applies.
    Returns:
        [{"params": decayed, ["weight_decay": wd]}, {"params": not_decayed, "weight_decay": 0.0}], followed, when
        some spec has ``embedding_or_output``, by the same two for those params, marked
        ``{EMBEDDING_OR_OUTPUT: True}``.
    Raises:
        ValueError: params and specs differ in length.
    """
    if len(params) != len(specs):
        raise ValueError(f"param_groups: {len(params)} params but {len(specs)} specs")
    kinds = (False, True) if any(s.embedding_or_output for s in specs) else (False,)
    groups = []
    for marked in kinds:
        decay = [p for p, s in zip(params, specs) if s.embedding_or_output == marked and not s.no_weight_decay]
        no_decay = [p for p, s in zip(params, specs) if s.embedding_or_output == marked and s.no_weight_decay]
        first: dict = {"params": decay}
        if weight_decay is not None:
            first["weight_decay"] = float(weight_decay)
        pair = [first, {"params": no_decay, "weight_decay": 0.0}]
        groups += [{**g, EMBEDDING_OR_OUTPUT: True} for g in pair] if marked else pair
    return groups


def megatron_keywords(cfg) -> dict:
    """Every keyword the Megatron-named `optim` keys map to; each reaches a target only if it takes it."""
    return {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
            "weight_decay": cfg.weight_decay, "momentum": cfg.sgd_momentum}


# optim.impl=apex: apex's fused kernels exist for these torch classes only (a property of apex, not
# a list of options): the imported target -> (apex class, its fixed keywords).
APEX_KERNELS: dict[type, tuple[str, dict]] = {
    torch.optim.Adam: ("FusedAdam", {"adam_w_mode": False}),
    torch.optim.AdamW: ("FusedAdam", {"adam_w_mode": True}),
    torch.optim.SGD: ("FusedSGD", {}),
}


def _apex_optimizer(target: type, groups: list[dict], mapped: dict):
    """apex's fused kernel for the torch class `target`, with the mapped keywords its signature takes."""
    import apex.optimizers  # noqa: PLC0415 - optional dependency

    name, fixed = APEX_KERNELS[target]
    cls = getattr(apex.optimizers, name)
    accepted = components.accepted_keywords(cls)
    kwargs = {k: v for k, v in mapped.items() if accepted is None or k in accepted}
    return cls(groups, **kwargs, **fixed)


def _apex_available() -> bool:
    try:
        import apex.optimizers  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _fused_kernel_available(groups: list[dict]) -> bool:
    """Every param on one CUDA or CPU device type (torch's fused Adam / AdamW / SGD kernels)."""
    types = {p.device.type for g in groups for p in g["params"]}
    return types in ({"cuda"}, {"cpu"})


def check_optimizer_values(cfg) -> None:
    """Value ranges of the Megatron optimizer keys and ``optim.impl``; pure.

    Raises:
        ConfigError: one line per rule, naming the key and the fix.
    """
    if cfg.impl not in IMPLS:
        raise ConfigError(f"optim: unknown optim.impl={cfg.impl!r}; pick one of {', '.join(IMPLS)}")
    rules = (
        (cfg.lr >= 0, f"optim.lr={cfg.lr} must be >= 0; set optim.lr to the peak learning rate, e.g. 3e-4"),
        (cfg.min_lr <= cfg.lr, f"optim.min_lr={cfg.min_lr} must be <= optim.lr={cfg.lr}; lower optim.min_lr"),
        (cfg.weight_decay >= 0, f"optim.weight_decay={cfg.weight_decay} must be >= 0; use 0 for none"),
        (0 <= cfg.adam_beta1 < 1, f"optim.adam_beta1={cfg.adam_beta1} must be in [0, 1); e.g. 0.9"),
        (0 <= cfg.adam_beta2 < 1, f"optim.adam_beta2={cfg.adam_beta2} must be in [0, 1); e.g. 0.999 or 0.95"),
        (cfg.adam_eps > 0, f"optim.adam_eps={cfg.adam_eps} must be > 0; e.g. 1e-8"),
    )
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def optimizer_node(cfg) -> tuple[dict, Callable]:
    """The component node of ``cfg`` (``_target_`` + the user's own keys) and the imported target.

    Raises:
        ConfigError: ``optim._target_`` is missing or does not import.
    """
    target = getattr(cfg, "_target_", None)
    return {"_target_": target, **components.extra_keys(cfg)}, components.import_target("optim", target)


def build_optimizer_factory(cfg) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A function ``param_groups -> optimizer`` for the `OptimConfig` ``cfg`` (see the module docstring).

    Raises (at once, not when the factory is called):
        ConfigError: `check_optimizer_values`; a ``_target_`` that does not import or lacks a method;
            ``impl=apex`` for a target apex has no kernel for, or without apex installed. Keyword errors
            of the target are raised when the factory is called (`check_optimizer` calls it at start-up).
    """
    check_optimizer_values(cfg)
    node, target = optimizer_node(cfg)
    components.resolve("optim", node, OPTIMIZER)  # import + interface now
    impl = cfg.impl
    if impl == "apex":
        if target not in APEX_KERNELS:
            names = ", ".join(f"torch.optim.{c.__name__}" for c in APEX_KERNELS)
            raise ConfigError(f"optim.impl=apex: apex has fused kernels only for {names}, not "
                              f"optim._target_={cfg._target_}; use optim.impl=auto")
        if not _apex_available():
            raise ConfigError(
                "optim: optim.impl=apex but apex.optimizers is not importable; install NVIDIA apex from source "
                "or use optim.impl=auto (torch fused/foreach kernels)"
            )
    mapped = megatron_keywords(cfg)

    def build(groups: list[dict]):
        if impl == "apex":
            return _apex_optimizer(target, groups, mapped)
        _, accepted_kw = components.resolve("optim", node, OPTIMIZER, mapped={"fused": True})
        fused = _fused_kernel_available(groups) and "fused" in accepted_kw
        kernel = {"fused": True} if fused else {"foreach": True}
        return components.build("optim", node, OPTIMIZER, runtime={"params": groups}, mapped={**mapped, **kernel})

    return build


def optimizer_kernel(optimizer) -> str:
    """What runs for the inner optimizer ``optimizer``, for the start-up log: its class's dotted path and,
    for torch's optimizers, the kernel (``torch.optim.AdamW (fused=True)``, ``... (foreach=True)``)."""
    cls = type(optimizer)
    path = f"{cls.__module__}.{cls.__qualname__}"
    if getattr(torch.optim, cls.__name__, None) is cls:
        path = f"torch.optim.{cls.__name__}"  # torch.optim.adamw.AdamW is exported as torch.optim.AdamW
    defaults = getattr(optimizer, "defaults", {}) or {}
    kernel = next((f"{k}=True" for k in ("fused", "foreach") if defaults.get(k)), None)
    if kernel is None and "foreach" in defaults:
        kernel = "for-loop"  # torch's single-tensor path
    return f"{path} ({kernel})" if kernel else path


def weight_decay_coupling(optimizer) -> Optional[str]:
    """How ``optimizer`` applies weight decay: "decoupled" (AdamW, Loshchilov & Hutter 2019: p -= lr·wd·p, apart
    from the adaptive step), "coupled" (L2: wd·p added to the gradient, then scaled by the adaptive step like it),
    or None when the class does not say (a user's optimizer).

    torch's Adam / NAdam / RAdam carry ``decoupled_weight_decay`` in their defaults (AdamW sets it); apex's
    FusedAdam its ``adam_w_mode``; torch's other optimizers and apex's FusedSGD add the decay to the gradient.
    """
    defaults = getattr(optimizer, "defaults", {}) or {}
    if isinstance(optimizer, torch.optim.AdamW):  # torch < 2.5: AdamW did not share Adam's flag
        return "decoupled"
    if "decoupled_weight_decay" in defaults:
        return "decoupled" if defaults["decoupled_weight_decay"] else "coupled"
    if hasattr(optimizer, "adam_w_mode"):  # apex FusedAdam (and FusedLAMB)
        return "decoupled" if optimizer.adam_w_mode else "coupled"
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") or cls.__name__ == "FusedSGD":
        return "coupled"
    return None


def weight_decay_note(optimizer) -> str:
    """`` weight_decay=W coupled (L2 ...)`` / `` ... decoupled (AdamW)`` for the start-up log's ``kernels:`` line
    (`weight_decay_coupling`); W = the largest of the param groups' (biases and norms have none). Empty when no
    group decays. torch's Adam adds the note that Megatron's ``--optimizer adam`` is decoupled (optim=adamw)."""
    decay = max((group.get("weight_decay") or 0.0 for group in getattr(optimizer, "param_groups", [])), default=0.0)
    if not decay:
        return ""
    coupling = weight_decay_coupling(optimizer)
    if coupling == "decoupled":
        return f" weight_decay={decay:g} decoupled (AdamW: p -= lr*wd*p)"
    if coupling is None:
        return f" weight_decay={decay:g} (coupled or decoupled: {type(optimizer).__name__} does not say)"
    megatron = ("; Megatron's --optimizer adam decouples it: optim=adamw"
                if type(optimizer) is torch.optim.Adam else "")
    return f" weight_decay={decay:g} coupled (L2: wd*p added to the gradient{megatron})"


def check_optimizer(cfg):
    """Start-up check of ``optim`` (pure: config only, no collectives, no files): values, the
    component checks and a throwaway instance on a 1-element tensor, which it returns (the LR
    schedule's start-up check builds on it).

    Raises:
        ConfigError: one line naming the key, the dotted path and the fix.
    """
    return build_optimizer_factory(cfg)([{"params": [torch.nn.Parameter(torch.zeros(1))]}])
