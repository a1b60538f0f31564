"""The ``schedule`` group's schema (conf/schedule/*.yaml; docs/COMPONENTS.md "Pipeline schedule")."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ScheduleConfig:
    """Which pipeline schedule runs: a component built from ``_target_`` (`mptrain.schedules.build_schedule`).

    Keys a user's schedule takes (``+schedule.my_option=3``) are passed to it; they are checked
    against its signature at start-up.
    """

    name: str = "auto"
    """The option's name (conf/schedule/<name>.yaml): auto | no_pipelining | gpipe | 1f1b | interleaved_1f1b.
    Pick a schedule with ``schedule=<option>`` or ``schedule._target_=<dotted path>``, not with this key."""
    _target_: str = "mptrain.schedules.auto"
    """Dotted path of the schedule function (`mptrain.schedules.ForwardBackwardFunc`); ``auto``: no_pipelining
    for pp = 1, interleaved 1F1B when vpp > 1, else 1F1B."""
    _partial_: bool = True
    """The trainer passes the spec and the per-call arguments later (always a partial)."""
