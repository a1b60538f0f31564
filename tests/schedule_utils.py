"""Test helpers: a shipped schedule option's function (read from conf/schedule/<option>.yaml) and its spec."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from mptrain.components import import_target
from mptrain.schedules import ScheduleSpec

SCHEDULE_CONF = Path(__file__).resolve().parents[1] / "conf" / "schedule"


def schedule_fn(option: str):
    """The function ``schedule=<option>`` selects (its ``_target_``; the option list is conf/ only)."""
    return import_target("schedule", OmegaConf.load(SCHEDULE_CONF / f"{option}.yaml")["_target_"])


def make_spec(groups, *, num_microbatches: int, seq_length: int, micro_batch_size: int, hidden_size: int,
              max_tokens, dtype=torch.float32, sequence_parallel: bool = False) -> ScheduleSpec:
    return ScheduleSpec(groups=groups, num_microbatches=num_microbatches, seq_length=seq_length,
                        micro_batch_size=micro_batch_size, hidden_size=hidden_size, dtype=dtype,
                        sequence_parallel=sequence_parallel, max_tokens=max_tokens)
