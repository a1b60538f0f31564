"""Throughput: tokens/s, TFLOP/s per GPU, MFU, start-up times, memory (DESIGN.md §2).

FLOPs per iteration and the peak rates come from `mptrain.layers.params` (`flops_per_iteration`,
`DENSE_BF16_PEAK_TFLOPS`), the one home of that arithmetic, shared with the planner and the
benchmark harness. MFU = F / time / GPUs / peak, with peak the dense bf16 rate for every
precision; None when the peak is unknown (CPU). "GPU" means a process in the world.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from mptrain.layers.params import peak_tflops_for_device

GIB = 2**30


def peak_tflops_per_gpu(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """Dense bf16 peak of `device` in TFLOP/s (`run.peak_tflops_per_gpu` wins); None on CPU / unknown GPUs."""
    if override is not None:
        return float(override)
    if torch.device(device).type != "cuda":
        return None
    return peak_tflops_for_device(torch.cuda.get_device_name(device))


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Rates over a timed span. tokens_per_s over the whole world; the others per process."""

    tokens_per_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: Optional[float]


def throughput(*, flops: float, tokens: int, elapsed_s: float, num_gpus: int, peak_tflops: Optional[float]) -> Throughput:
    """Rates for `tokens` / `flops` processed by `num_gpus` processes in `elapsed_s` seconds.

    Raises:
        ValueError: elapsed_s <= 0 or num_gpus < 1.
    """
    if elapsed_s <= 0 or num_gpus < 1:
        raise ValueError(f"throughput: elapsed_s={elapsed_s} must be > 0 and num_gpus={num_gpus} >= 1")
    tflops_per_gpu = flops / elapsed_s / num_gpus / 1e12
    return Throughput(
        tokens_per_s=tokens / elapsed_s,
        tokens_per_s_per_gpu=tokens / elapsed_s / num_gpus,
        tflops_per_gpu=tflops_per_gpu,
        mfu=None if peak_tflops is None else tflops_per_gpu / peak_tflops,
    )


def memory_allocated_gib(device: torch.device) -> Optional[float]:
    """Currently allocated accelerator memory (GiB); None on CPU."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_allocated(device) / GIB


def peak_memory_gib(device: torch.device) -> Optional[float]:
    """Peak allocated accelerator memory since start / last reset (GiB); None on CPU."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / GIB


class StartupClock:
    """Seconds from a start time to named milestones ("init": groups built, "first_step": step 1 done).

    Args:
        t0: the start, from `time.time()` taken as early as possible (train.py's import);
            None = now.
    """

    def __init__(self, t0: Optional[float] = None) -> None:
        self.t0 = time.time() if t0 is None else t0
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> float:
        """Record (once) and return seconds since t0 for `name`."""
        if name not in self.marks:
            self.marks[name] = time.time() - self.t0
        return self.marks[name]

    def as_dict(self) -> dict:
        """{"<name>_s": seconds} for the log / summary, e.g. {"init_s": 3.1, "first_step_s": 9.8}."""
        return {f"{k}_s": v for k, v in self.marks.items()}
