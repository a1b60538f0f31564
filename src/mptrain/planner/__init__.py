"""The layout planner: per-rank parameter counts, memory, communication, ranking.

`params.py` (per-rank elements), `memory.py` (bytes per stage), `moe.py` (an MoE layer's routed
activations and token-dispatch traffic), `layouts.py` (enumeration, comm, bubble, ranking), `config.py`
(the `plan` primary config). Entry points: `python -m mptrain.plan`,
`python -m mptrain.check`. docs/PLANNER.md explains the formulas and the measured constants.
"""

from mptrain.planner.config import HardwareConfig
from mptrain.planner.layouts import candidate_layouts, plan, plan_layout
from mptrain.planner.memory import MemoryParts, PlanLayout, stage_memory
from mptrain.planner.params import RankParams, all_rank_params, rank_params

__all__ = ["HardwareConfig", "MemoryParts", "PlanLayout", "RankParams", "all_rank_params", "candidate_layouts", "plan",
           "plan_layout", "rank_params", "stage_memory"]
