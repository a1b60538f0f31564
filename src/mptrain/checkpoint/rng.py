"""Per-rank RNG states in checkpoints: saved per (tp, pp, dp) coordinate, restored or re-derived.

Saved under ``rng/tp<t>_pp<p>_dp<d>``: python ``random``, numpy, torch CPU, every CUDA device, and
the model-parallel `RNGStatesTracker` (Megatron ``checkpointing.py::get_rng_state``, which also
keys them by rank). They are restored only when the checkpoint's layout (tp, pp, dp, vpp) equals
the current one: otherwise a coordinate names a different piece of the model and its stream
would not be the one an uninterrupted run of this layout has. Then the streams are re-derived
from (``train.seed``, the iteration, the rank's coordinates): the tracker is re-seeded by
`mptrain.layers.random.init_rng_tracker` with ``stream_offset = ITERATION_STRIDE · iteration``
(so a resumed run does not replay the masks of iteration 1), and python / numpy are seeded from
the same numbers. With dropout 0 (the parity tests) nothing draws from these streams.
"""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from mptrain.layers.random import init_rng_tracker

ITERATION_STRIDE = 1_000_003  # a prime far above the pp stride (100) and tp offset (2718 + tp) of random.py


def rng_key(groups) -> str:
    """``rng/tp<t>_pp<p>_dp<d>``, with ``_cp<c>`` under context parallelism (each CP rank is its own process)."""
    cp = getattr(groups, "cp_size", 1)
    return f"rng/tp{groups.tp_rank}_pp{groups.pp_rank}_dp{groups.dp_rank}" + (f"_cp{groups.cp_rank}" if cp > 1 else "")


def layout_of(groups) -> dict:
    """The layout facts that decide whether saved RNG states apply (also saved for humans); ``cp`` only when > 1."""
    layout = {"world_size": groups.world_size, "tp": groups.tp_size, "pp": groups.pp_size, "dp": groups.dp_size,
              "vpp": groups.vpp_size}
    if getattr(groups, "cp_size", 1) > 1:
        layout["cp"] = groups.cp_size
    return layout


def capture(rng_tracker) -> dict:
    """This process's RNG states (all tensors on CPU)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": rng_tracker.state_dict() if rng_tracker is not None else None,
    }


def restore(state: dict, rng_tracker) -> None:
    """Inverse of `capture`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if rng_tracker is not None and state.get("tracker") is not None:
        rng_tracker.load_state_dict(state["tracker"])


def rederive(seed: int, iteration: int, groups, rng_tracker) -> None:
    """Fresh streams for (seed, iteration, this rank's coordinates); see the module docstring."""
    offset = ITERATION_STRIDE * iteration
    fresh = init_rng_tracker(seed, groups, groups.device, stream_offset=offset)  # also torch.manual_seed
    if rng_tracker is not None:
        rng_tracker.load_state_dict(fresh.state_dict())
    host_seed = (seed * 1_000_003 + offset + 7919 * groups.pp_rank + 104_729 * groups.tp_rank) % (2**32)
    random.seed(host_seed)
    np.random.seed(host_seed)


def restore_or_rederive(saved: Optional[dict], saved_layout: dict, *, seed: int, iteration: int, groups,
                        rng_tracker) -> Optional[str]:
    """Restore this rank's saved states when the layout matches, else re-derive them.

    Returns:
        None when restored; otherwise the reason (for the run log).
    """
    current = layout_of(groups)
    if saved is not None and saved_layout == current:
        restore(saved, rng_tracker)
        return None
    if saved_layout != current:
        reason = f"layout changed ({_fmt(saved_layout)} -> {_fmt(current)})"
    else:
        reason = f"no RNG state saved for {rng_key(groups)}"
    rederive(seed, iteration, groups, rng_tracker)
    return reason


def _fmt(layout: dict) -> str:
    return f"tp{layout.get('tp')} pp{layout.get('pp')} dp{layout.get('dp')} vpp{layout.get('vpp')}"
