"""Pipeline schedules: components selected by ``schedule._target_`` (docs/COMPONENTS.md "Pipeline schedule").

The shipped options (conf/schedule/*.yaml) keep their names and set ``_target_``:
``no_pipelining`` → `mptrain.schedules.no_pipelining.forward_backward_no_pipelining`, ``gpipe`` →
`mptrain.schedules.gpipe.forward_backward_gpipe`, ``1f1b`` →
`mptrain.schedules.one_f_one_b.forward_backward_1f1b`, ``interleaved_1f1b`` →
`mptrain.schedules.interleaved.forward_backward_interleaved_1f1b`, and ``auto`` (the default) →
`mptrain.schedules.auto`. A user's schedule is ``schedule._target_=my_pkg.my_schedule``.

Every schedule has the `ForwardBackwardFunc` signature ``fn(spec: ScheduleSpec, *, forward_step_func,
data_iterator, model, forward_only, loss_scale, no_sync_func, stats)``. Layout rules live with the
schedule they belong to, as its optional ``check_layout(PipelineLayout)`` (pure): `resolve_schedule`
applies them once at start-up (from `mptrain.training.validate.validate_config`, before any process
group exists) and `build_schedule` builds what they selected. Communication lives in `p2p.py`; the
shared forward/backward step and the loss normalisation in `common.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mptrain import components
from mptrain.errors import ConfigError
from mptrain.schedules import p2p
from mptrain.schedules.common import (
    InflightCounter,
    ScheduleStats,
    backward_step,
    forward_step,
    new_step_state,
    no_sync_context,
    set_input_tensor,
)
from mptrain.schedules.gpipe import forward_backward_gpipe
from mptrain.schedules.interface import (
    SCHEDULE_KIND,
    ForwardBackwardFunc,
    PipelineLayout,
    ScheduleSpec,
    check_signature,
    dotted_path,
    pipeline_tensor_shape,
)
from mptrain.schedules.interleaved import forward_backward_interleaved_1f1b
from mptrain.schedules.no_pipelining import forward_backward_no_pipelining
from mptrain.schedules.one_f_one_b import forward_backward_1f1b

KEY = "schedule"  # the config node
_MAX_HOPS = 4  # check_layout redirections followed (auto → 1f1b → itself); more means a cycle


def select_for_layout(layout: PipelineLayout) -> ForwardBackwardFunc:
    """``schedule=auto`` (DESIGN.md §1): no_pipelining for pp = 1, interleaved 1F1B when vpp > 1, else 1F1B."""
    if layout.pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    if layout.virtual_pipeline_model_parallel_size:
        return forward_backward_interleaved_1f1b
    return forward_backward_1f1b


def auto(spec: ScheduleSpec, **call: Any) -> tuple:
    """The schedule `select_for_layout` picks for ``spec``'s layout, called with the same arguments.

    Start-up resolves ``auto`` already (its ``check_layout`` returns the pick), so the trainer calls
    the picked schedule directly; this body serves direct callers.
    """
    return select_for_layout(spec.layout)(spec, **call)


auto.check_layout = select_for_layout


def schedule_name(fn: Callable) -> str:
    """What layout.json and the log call a schedule: the option name of a built-in (its function is
    ``forward_backward_<option>`` in this package, or `auto`), else the dotted path of the target."""
    path = dotted_path(fn)
    if path.startswith(__name__ + "."):
        return fn.__name__.removeprefix("forward_backward_")
    return path


@dataclasses.dataclass(frozen=True)
class ResolvedSchedule:
    """The schedule that will run, as `resolve_schedule` found it.

    Attributes:
        fn: the function (after ``check_layout`` redirections: ``auto`` → the built-in for the layout).
        target: its dotted path (what `build_schedule` instantiates).
        name: `schedule_name` of ``fn`` (`DerivedLayout.schedule`, layout.json).
        kwargs: the node's own keywords bound to ``fn`` (a user schedule's options), besides the runtime ones.
    """

    fn: Callable
    target: str
    name: str
    kwargs: dict


def resolve_schedule(node: Any, layout: PipelineLayout) -> ResolvedSchedule:
    """Import ``schedule._target_``, check its signature and option name, apply its layout rules (pure).

    Args:
        node: the ``schedule`` config node (`ScheduleConfig`, DictConfig or mapping with ``_target_``).
        layout: the job's `PipelineLayout`.
    Raises:
        ConfigError: one line naming ``schedule._target_`` (does not import, not callable, wrong
            signature, an unknown keyword), ``schedule.name`` (a built-in target under another
            option's name, e.g. ``schedule.name=gpipe`` without ``schedule=gpipe``), or the layout
            keys a schedule's ``check_layout`` rejects (``virtual_pipeline_model_parallel_size``, ...).
    """
    fn, kwargs = components.resolve(KEY, node, SCHEDULE_KIND, drop=("name",))
    target = str(components.node_items(node).get("_target_"))
    check_signature(KEY, target, fn)
    name = components.node_items(node).get("name")
    builtin = schedule_name(fn)
    if name is not None and builtin != dotted_path(fn) and name != builtin:
        raise ConfigError(f"schedule.name: unknown option {name!r} for schedule._target_={target} (the built-in "
                          f"option {builtin!r}); pick a schedule with schedule=<option> (a file in conf/schedule/: "
                          f"auto, 1f1b, ...), not schedule.name, or set schedule._target_ to your own schedule")
    for _ in range(_MAX_HOPS):
        check = getattr(fn, "check_layout", None)
        nxt = check(layout) if check is not None else None
        if nxt is None or nxt is fn:
            break
        if kwargs:  # the node's keywords were for the configured target, not for its replacement
            raise ConfigError(f"schedule: {target} runs {dotted_path(nxt)} on this layout, which takes none of "
                              f"schedule.{', schedule.'.join(sorted(kwargs))}; remove them or pick another layout")
        check_signature(KEY, dotted_path(nxt), nxt)
        fn = nxt
    else:
        raise ConfigError(f"schedule._target_={target}: check_layout redirections do not settle after {_MAX_HOPS} hops")
    return ResolvedSchedule(fn=fn, target=dotted_path(fn), name=schedule_name(fn), kwargs=kwargs)


def build_schedule(node: Any, spec: ScheduleSpec) -> Callable:
    """The one place a schedule is built: `resolve_schedule` for ``spec.layout``, then
    `mptrain.components.build` (a ``functools.partial`` with the node's own keywords bound).

    Returns:
        ``fn`` to call as ``fn(spec, forward_step_func=..., ...)`` (`ForwardBackwardFunc`).
    """
    resolved = resolve_schedule(node, spec.layout)
    return components.build(KEY, {"_target_": resolved.target, **resolved.kwargs}, SCHEDULE_KIND, partial=True)


__all__ = [
    "ForwardBackwardFunc",
    "InflightCounter",
    "PipelineLayout",
    "ResolvedSchedule",
    "SCHEDULE_KIND",
    "ScheduleSpec",
    "ScheduleStats",
    "auto",
    "backward_step",
    "build_schedule",
    "forward_backward_1f1b",
    "forward_backward_gpipe",
    "forward_backward_interleaved_1f1b",
    "forward_backward_no_pipelining",
    "forward_step",
    "new_step_state",
    "no_sync_context",
    "p2p",
    "pipeline_tensor_shape",
    "resolve_schedule",
    "schedule_name",
    "select_for_layout",
    "set_input_tensor",
]
