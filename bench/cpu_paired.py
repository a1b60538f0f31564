#!/usr/bin/env python3
"""mptrain tp1pp1 vs the eager reference GPT in ONE process, step by step (the CPU benchmark row).

    OMP_NUM_THREADS=1 PYTHONPATH=src:tests python bench/cpu_paired.py [--iters 60] [extra Hydra overrides]

Each mptrain ``Trainer.train_step`` is preceded by one step of `bench/cpu_reference.py`'s model, so a
busy shared machine slows both alike; per step it records thread-CPU time (``time.thread_time``,
less load-sensitive than wall time), wall time and minor page faults of each. Prints one JSON line:
the medians, the medians of the per-pair speed ratios (reference / mptrain: > 1 = mptrain faster)
and the page faults per step. The shape and the optimizer are `bench/cpu_compare.py`'s. Both run in
one heap here, so the reference's page faults are mptrain's allocator settings' too
(``run.cpu_malloc_tuning``): `bench/cpu_compare.py` (separate processes) is the comparison of record.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT / "src")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    import torch

    import cpu_reference as R
    from cpu_compare import SHAPE as S, mptrain_overrides
    from mptrain.training import step as stepmod
    from mptrain.training.run import run
    from train_utils import compose

    torch.manual_seed(0)
    model = R.GPT(S["layers"], S["hidden"], S["heads"], S["seq"], 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)

    def ref_step() -> None:
        tokens = torch.randint(0, 1000, (S["mbs"], S["seq"] + 1), generator=gen)
        loss = model(tokens[:, :-1], tokens[:, 1:], torch.ones(S["mbs"], S["seq"]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)

    def sample():
        return time.thread_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    rows = []
    orig = stepmod.Trainer.train_step

    def train_step(self, *args, **kw):
        s0 = sample()
        ref_step()
        s1 = sample()
        out = orig(self, *args, **kw)
        s2 = sample()
        rows.append([s1[i] - s0[i] for i in range(3)] + [s2[i] - s1[i] for i in range(3)])
        return out

    stepmod.Trainer.train_step = train_step
    with tempfile.TemporaryDirectory() as tmp:
        run(compose([*mptrain_overrides(a.iters + a.warmup, f"{tmp}/run"), *a.extra]))
    rows = rows[a.warmup:]
    med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
    print(json.dumps({
        "reference_thread_ms": round(med(0) * 1e3, 2), "mptrain_thread_ms": round(med(3) * 1e3, 2),
        "reference_wall_ms": round(med(1) * 1e3, 2), "mptrain_wall_ms": round(med(4) * 1e3, 2),
        "speed_thread_paired": round(statistics.median(r[0] / r[3] for r in rows), 4),
        "speed_wall_paired": round(statistics.median(r[1] / r[4] for r in rows), 4),
        "reference_minflt_per_step": med(2), "mptrain_minflt_per_step": med(5), "steps": len(rows),
        "extra": a.extra}))


if __name__ == "__main__":
    main()
