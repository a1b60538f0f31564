"""Pipeline schedules, selected by name (`schedule=auto|no_pipelining|gpipe|1f1b|interleaved_1f1b`).

Every schedule is one function with the same keyword-only signature (docs/ARCHITECTURE.md
"Schedules"); `get_forward_backward_func` looks it up in an exhaustive registry. Communication
lives in `p2p.py`; the shared forward/backward step and the loss normalisation in `common.py`.
"""

from __future__ import annotations

import types
from typing import Callable

from mptrain.errors import ConfigError
from mptrain.groups import ParallelGroups
from mptrain.schedules.common import ScheduleStats, pipeline_tensor_shape
from mptrain.schedules.gpipe import forward_backward_gpipe
from mptrain.schedules.interleaved import forward_backward_interleaved_1f1b
from mptrain.schedules.no_pipelining import forward_backward_no_pipelining
from mptrain.schedules.one_f_one_b import forward_backward_1f1b

# read-only: name -> schedule function
SCHEDULES = types.MappingProxyType(
    {
        "no_pipelining": forward_backward_no_pipelining,
        "gpipe": forward_backward_gpipe,
        "1f1b": forward_backward_1f1b,
        "interleaved_1f1b": forward_backward_interleaved_1f1b,
    }
)
SCHEDULE_NAMES = ("auto",) + tuple(SCHEDULES)


def resolve_schedule_name(name: str, *, pp_size: int, vpp_size) -> str:
    """``auto`` → no_pipelining (pp = 1), interleaved_1f1b (vpp > 1), else 1f1b; other names are checked.

    Raises:
        ConfigError: an unknown name, or a name that cannot run this layout (no_pipelining with pp > 1,
            interleaved without vpp > 1, gpipe / 1f1b with vpp > 1).
    """
    interleaved = (vpp_size or 1) > 1
    if name == "auto":
        return "no_pipelining" if pp_size == 1 else ("interleaved_1f1b" if interleaved else "1f1b")
    if name not in SCHEDULES:
        raise ConfigError(f"schedule: unknown schedule {name!r}; valid: {', '.join(SCHEDULE_NAMES)}")
    if name == "no_pipelining" and pp_size > 1:
        raise ConfigError(
            f"schedule=no_pipelining needs pipeline_model_parallel_size=1 (got {pp_size}); use schedule=auto, 1f1b or gpipe"
        )
    if name == "interleaved_1f1b" and not interleaved:
        raise ConfigError(
            f"schedule=interleaved_1f1b needs virtual_pipeline_model_parallel_size > 1 (got {vpp_size}) and "
            f"pipeline_model_parallel_size > 1 (got {pp_size}); pick parallel=tp1pp2vpp2 or schedule=1f1b"
        )
    if name in ("gpipe", "1f1b") and interleaved:
        raise ConfigError(
            f"schedule={name} runs one model chunk per rank but virtual_pipeline_model_parallel_size={vpp_size}; "
            "use schedule=interleaved_1f1b (or auto), or set virtual_pipeline_model_parallel_size=null"
        )
    return name


def get_forward_backward_func(name: str, groups: ParallelGroups) -> Callable:
    """The schedule function for ``name`` on this layout (Megatron ``get_forward_backward_func``, minus its globals).

    The returned ``fn`` is called with keyword arguments only::

        reports, num_tokens = fn(forward_step_func=..., data_iterator=..., model=[chunk, ...],
                                 num_microbatches=m, seq_length=s, micro_batch_size=b, hidden_size=h,
                                 groups=groups, dtype=torch.float32, sequence_parallel=False,
                                 forward_only=False, loss_scale=1.0, max_tokens=gbs * s,
                                 no_sync_func=None, stats=None)

    - ``forward_step_func(data_iterator, chunk) -> (output, loss_func)``; ``loss_func(output) ->
      (loss_sum, num_tokens, report)`` is called on the last stage only.
    - ``model``: one chunk per virtual stage (one without interleaving); chunks (or the modules
      they wrap under ``.module``) expose ``set_input_tensor(t)``, t ``[s(/tp), b, h]`` or None.
    - ``data_iterator``: one iterator, or (interleaved) a list with one per chunk.
    - the last stage backpropagates ``loss_sum · loss_scale / max_tokens`` per micro-batch (see
      `mptrain.schedules.common`); the caller's finalize_model_grads rescales by
      ``max_tokens / DP-reduced num_tokens``.
    - ``no_sync_func``: context-manager factory (or list per chunk) from the DP wrapper; every
      backward but the last one of each chunk runs under it.
    - ``stats``: a `ScheduleStats` (max in-flight micro-batches, p2p bytes sent) or None.
    - returns ``(reports, num_tokens)``: one report per micro-batch and the int64 token count on the
      last stage; ``([], 0)`` elsewhere.
    - ``forward_only=True`` runs the forwards under ``torch.no_grad()`` (evaluation).

    Raises:
        ConfigError: see `resolve_schedule_name`; the returned fn raises ConfigError for invalid
            micro-batch counts (interleaved: a multiple of pp) before any communication.
    """
    return SCHEDULES[resolve_schedule_name(name, pp_size=groups.pp_size, vpp_size=groups.vpp_size)]


__all__ = [
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "ScheduleStats",
    "get_forward_backward_func",
    "pipeline_tensor_shape",
    "resolve_schedule_name",
]
