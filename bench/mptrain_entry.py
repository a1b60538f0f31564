"""train.py for benchmarks: the same Hydra entry, plus a per-rank record of peak memory.

    torchrun --standalone --nproc_per_node=N bench/mptrain_entry.py [--bench-profile FILE] <overrides>

Runs exactly what `train.py` runs (`mptrain.training.run.hydra_main`), then every rank writes
``<run.dir>/bench_rank<R>.json``: {"rank", "peak_alloc_gib", "peak_reserved_gib"} from
`torch.cuda.max_memory_allocated` / `max_memory_reserved` (GiB = 2^30 bytes; null on CPU) — the
metrics rows carry rank 0's current allocation only, and the benchmark reports the max over ranks,
as the peer does. No collective is needed after the run (each rank writes its own file).

``--bench-profile FILE`` (stripped before Hydra sees the command line): run the job under
`torch.profiler` and write rank 0's top kernels by device time to FILE (a text table). Timings
of a profiled run are not benchmark numbers.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import hydra

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def _pop_flag(argv: list, flag: str):
    """Remove ``flag VALUE`` from argv; return VALUE or None."""
    if flag in argv:
        i = argv.index(flag)
        value = argv[i + 1]
        del argv[i:i + 2]
        return value
    return None


PROFILE_FILE = _pop_flag(sys.argv, "--bench-profile")
PROFILE_SKIP = 3  # iterations not profiled (compile, autotune, NCCL set-up)

from mptrain.config.schema import register  # noqa: E402  (after sys.path is final)

register()


def _write_peak(run_dir: str) -> None:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    rec = {
        "rank": rank,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
    }
    Path(run_dir, f"bench_rank{rank}.json").write_text(json.dumps(rec) + "\n")


# Kernel-name patterns -> a time-split category (first match wins; attention before GEMM because
# the memory-efficient attention kernels are CUTLASS kernels too).
KERNEL_CATEGORIES = (
    ("nccl", ("nccl",)),
    ("attention (flash/mem-efficient)", ("fmha", "flash", "attention", "efficient")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "nvjet", "gemv", "matmul")),
    ("multi-tensor (optimizer/unscale/norm)", ("multi_tensor", "adam", "foreach", "unscale", "amp_")),
    ("triton (compiled)", ("triton",)),
    ("softmax", ("softmax",)),
    ("layer_norm", ("layer_norm", "layernorm")),
    ("copy/cast/fill", ("copy", "memcpy", "memset", "cast", "fill")),
    ("elementwise/reduce", ("elementwise", "vectorized", "reduce", "unrolled")),
)


def kernel_category(name: str) -> str:
    """The time-split category of a CUDA kernel `name` (``KERNEL_CATEGORIES``; else "other")."""
    low = name.lower()
    for category, patterns in KERNEL_CATEGORIES:
        if any(p in low for p in patterns):
            return category
    return "other"


def _is_kernel(e) -> bool:
    """A CUDA kernel / memcpy row of `key_averages()`, not a user annotation spanning kernels
    (``nccl:all_reduce``, ``record_param_comms``, ``Optimizer.step#...``), which would double count."""
    from torch.autograd import DeviceType

    if getattr(e, "device_type", None) != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
        return False
    return not (e.key.startswith(("nccl:", "Optimizer.")) or e.key == "record_param_comms")


def time_split(averages, iterations: int = 1) -> str:
    """Device time per kernel category (ms per iteration and %), from `key_averages()` over `iterations`."""
    totals: dict = {}
    for e in averages:
        if not _is_kernel(e):
            continue
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        totals[kernel_category(e.key)] = totals.get(kernel_category(e.key), 0.0) + us
    whole = sum(totals.values()) or 1.0
    lines = [f"{'category':40s} {'ms/iter':>10s} {'%':>6s}"]
    for category, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"{category:40s} {us / 1e3 / iterations:10.2f} {100 * us / whole:6.1f}")
    lines.append(f"{'total kernel time':40s} {whole / 1e3 / iterations:10.2f}")
    return "\n".join(lines)


def _run_profiled(cfg, hydra_main):
    """Profile the steady-state iterations: all but the first `PROFILE_SKIP` (compile, autotune,
    NCCL set-up), by stepping the profiler after each `Trainer.train_step` (bench-only patch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from mptrain.training import step as step_module

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    active = max(1, int(cfg.train.train_iters) - PROFILE_SKIP)
    original = step_module.Trainer.train_step
    with profile(activities=acts, schedule=schedule(wait=PROFILE_SKIP - 1, warmup=1, active=active, repeat=1)) as prof:
        def stepped(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            prof.step()
            return out

        step_module.Trainer.train_step = stepped
        try:
            summary = hydra_main(cfg)
        finally:
            step_module.Trainer.train_step = original
    if int(os.environ.get("RANK", "0")) == 0:
        averages = prof.key_averages()
        key = "self_cpu_time_total"
        if cuda:
            key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
        table = averages.table(sort_by=key, row_limit=40, max_name_column_width=90)
        split = time_split(averages, active) if cuda else ""
        Path(PROFILE_FILE).write_text(f"# time split by kernel category (rank 0, {active} steady-state iterations after "
                                      f"{PROFILE_SKIP})\n{split}\n\n{table}")
    return summary


@hydra.main(version_base="1.3", config_path=str(ROOT / "conf"), config_name="config")
def main(cfg) -> None:
    from mptrain.training.run import hydra_main

    summary = _run_profiled(cfg, hydra_main) if PROFILE_FILE else hydra_main(cfg)
    _write_peak((summary or {}).get("run_dir") or cfg.run.dir)


if __name__ == "__main__":
    main()
