"""Throughput: FLOPs per iteration, tokens/s, TFLOP/s per GPU, MFU, start-up times, memory (DESIGN.md §2).

FLOPs per iteration — the only formula (the peer harness uses it too):

    F = 6·N·T + 12·L·h·s·T,     N = 12·L·h² + V_pad·h

T = tokens per iteration (global_batch_size × seq_length), L layers, h hidden size, s sequence
length, V_pad the padded vocabulary. 6·N·T counts forward (2 FLOPs per multiply-add) plus
backward (twice the forward) for every weight; 12·L·h·s·T is attention's QKᵀ and PV, counted in
full (no causal halving; Megatron core_v0.9's `num_floating_point_operations` for GPT with MHA:
72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)), the no-recompute form of Narayanan et al. 2021's FLOP
count, whose 96 includes the recomputed forward). Recompute is not counted (model FLOPs).

MFU = F / time / GPUs / peak, with peak the dense bf16 rate (989 TFLOP/s for H100 / H200 SXM) for
every precision; None when the peak is unknown (CPU). "GPU" means a process in the world.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

H100_H200_DENSE_BF16_TFLOPS = 989.0
# Dense bf16 tensor-core peaks (TFLOP/s) by a substring of torch.cuda.get_device_name; first match wins.
PEAK_TFLOPS_BY_NAME: tuple = (("H200", H100_H200_DENSE_BF16_TFLOPS), ("H100", H100_H200_DENSE_BF16_TFLOPS), ("A100", 312.0))
GIB = 2**30


def flops_num_params(num_layers: int, hidden_size: int, padded_vocab_size: int) -> int:
    """N = 12·L·h² + V_pad·h: the weights of the FLOP formula (no biases, norms or position table)."""
    return 12 * num_layers * hidden_size**2 + padded_vocab_size * hidden_size


def flops_per_iteration(
    *, num_layers: int, hidden_size: int, seq_length: int, padded_vocab_size: int, tokens_per_iteration: int
) -> int:
    """F = 6·N·T + 12·L·h·s·T (FLOPs, exact integer)."""
    n = flops_num_params(num_layers, hidden_size, padded_vocab_size)
    t = tokens_per_iteration
    return 6 * n * t + 12 * num_layers * hidden_size * seq_length * t


def peak_tflops_per_gpu(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """Dense bf16 peak of `device` in TFLOP/s (`run.peak_tflops_per_gpu` wins); None on CPU / unknown GPUs."""
    if override is not None:
        return float(override)
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_TFLOPS_BY_NAME:
        if key in name:
            return peak
    return None


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
