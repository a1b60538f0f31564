"""What a load takes from a checkpoint: everything (resume), weights only (``checkpoint.finetune``),
no optimizer (``checkpoint.load_optim=false``), no RNG (``checkpoint.load_rng=false``); and the check
that the optimizer a resumed run builds is the one whose state the checkpoint holds.

Megatron's flags and ours (``training/checkpointing.py::load_checkpoint``):

| mptrain                          | Megatron          | loaded                                                    |
|----------------------------------|-------------------|-----------------------------------------------------------|
| (default)                        |                   | weights, optimizer, scaler, LR schedule, iteration, RNG   |
| ``checkpoint.finetune=true``     | ``--finetune``    | weights (model + fp32 main params) only: iteration 0      |
| ``checkpoint.load_optim=false``  | ``--no-load-optim``| all but the optimizer state and the loss scaler          |
| ``checkpoint.load_rng=false``    | ``--no-load-rng`` | all but the RNG (re-derived from the seed, as on a layout change) |

One difference from Megatron: with ``load_optim=false`` the LR schedule still continues from the
checkpoint's step count (it is a function of the iteration, which continues); ``finetune`` is the
way to start a new schedule.

The optimizer check (`optimizer_change`) compares the checkpoint with the optimizer the run made
(the torch optimizer inside the wrapper, whatever ``optim._target_`` made it): the class named by
the saved config (``optim._target_``, or ``optim.name`` in checkpoints written before it), and the
per-parameter state keys and shapes (a probe step of the current class on a dummy parameter lists
the keys it keeps). Resuming across a change is refused unless ``load_optim=false`` / ``finetune``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from mptrain.errors import ConfigError


def check_load_keys(cfg: Any) -> None:
    """The load keys' rules (pure: config only), called by `validate_config`.

    Raises:
        ConfigError: ``load_optim`` / ``load_rng`` false or ``finetune`` without ``checkpoint.load``; ``finetune`` saving into the folder it
            loads from (a restart would fine-tune again from the job's own checkpoint, at iteration 0).
    """
    ck = cfg.checkpoint
    for key in ("load_optim", "load_rng"):  # what a load skips, set where nothing is loaded: no effect
        if getattr(ck, key, True) is False and not ck.load:
            raise ConfigError(f"checkpoint.{key}=false has no effect without checkpoint.load=<folder>; set it, or "
                              f"checkpoint.{key}=true")
    if not getattr(ck, "finetune", False):
        return
    if not ck.load:
        raise ConfigError("checkpoint.finetune=true needs checkpoint.load=<checkpoint folder with the weights>; "
                          "set it, or checkpoint.finetune=false")
    if ck.save and os.path.abspath(str(ck.save)) == os.path.abspath(str(ck.load)):
        raise ConfigError(f"checkpoint.finetune=true with checkpoint.save=checkpoint.load={ck.load}: a restart would "
                          "fine-tune again from this job's own checkpoint; save to another folder (to resume a "
                          "fine-tuning job later, load its checkpoint.save without finetune)")


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _saved_optimizer_class(saved_optim: dict) -> tuple[Optional[type], str]:
    """(class or None, how the saved config names it) from the checkpoint's ``optim`` config."""
    target = saved_optim.get("_target_")
    if target:
        try:
            from hydra.utils import get_class

            return get_class(str(target)), f"optim._target_={target}"
        except Exception:  # noqa: BLE001 - a plug-in no longer importable: compare by state keys only
            return None, f"optim._target_={target}"
    name = saved_optim.get("name")
    return None, (f"optim={name}" if name else "an unnamed optimizer")


def probe_state_keys(inner: torch.optim.Optimizer) -> Optional[set]:
    """The per-parameter state keys a step of ``type(inner)`` creates (None when the probe fails).

    One step on a dummy 2-element fp32 parameter with zero grad and the same defaults.
    """
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        opt = type(inner)([p], **dict(inner.defaults))
        p.grad = torch.zeros(2)
        opt.step()
        return set(opt.state[p].keys()) if p in opt.state else set()
    except Exception:  # noqa: BLE001 - a user's optimizer that cannot be probed this way
        return None


def optimizer_change(inner: torch.optim.Optimizer, saved_cfg: dict, current_cfg: dict, tensor_keys: dict,
                     object_keys: set) -> Optional[str]:
    """What differs between the checkpoint's optimizer state and the run's optimizer (None: nothing).

    Args:
        inner: the torch optimizer inside the run's wrapper.
        saved_cfg / current_cfg: the checkpoint's and the run's resolved config (plain dicts).
        tensor_keys: {key: (global shape, chunks)} of the checkpoint; object_keys: its object keys.
    Returns:
        a phrase for the error / log line, or None.
    """
    current = type(inner)
    saved_cls, saved_name = _saved_optimizer_class(saved_cfg.get("optim", {}) or {})
    now_name = f"{class_path(current)}"
    problems = []
    if saved_cls is not None and saved_cls is not current:
        problems.append(f"the checkpoint was saved with {saved_name} ({class_path(saved_cls)}), this run builds {now_name}")
    elif saved_cls is None and "name" in (saved_cfg.get("optim") or {}) and "name" in (current_cfg.get("optim") or {}):
        if saved_cfg["optim"]["name"] != current_cfg["optim"]["name"]:
            problems.append(f"the checkpoint was saved with {saved_name}, this run uses optim={current_cfg['optim']['name']} "
                            f"({now_name})")
    saved_keys = {k.rsplit("/", 1)[1] for k in list(tensor_keys) + list(object_keys) if k.startswith("optim/")}
    wanted = probe_state_keys(inner)
    # no saved state (an imported or iteration-0 checkpoint, or only skipped steps): nothing to mismatch
    if not problems and saved_keys and wanted is not None and saved_keys != wanted:
        problems.append(f"the checkpoint holds optimizer state {sorted(saved_keys)}, {now_name} keeps {sorted(wanted)}")
    shapes = []
    for key, (shape, _) in tensor_keys.items():
        if key.startswith("optim/"):
            name = key[len("optim/"):].rsplit("/", 1)[0]
            model = tensor_keys.get(f"model/{name}")
            if model is not None and tuple(model[0]) != tuple(shape):
                shapes.append(f"{key} {list(shape)} vs the parameter's {list(model[0])}")
    if shapes:
        problems.append("optimizer state shapes differ from the parameters': " + ", ".join(shapes[:4])
                        + (f" (+{len(shapes) - 4} more)" if len(shapes) > 4 else ""))
    return "; ".join(problems) if problems else None
