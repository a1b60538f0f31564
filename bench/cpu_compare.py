#!/usr/bin/env python3
"""mptrain at tp1pp1 vs the plain eager PyTorch GPT (`bench/cpu_reference.py`) on the CPU, interleaved runs.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/cpu_compare.py [--runs 3] [--iters 40] [--warmup 5]
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/cpu_compare.py --ab train.manual_gc=true [--runs 3] ...

Shape: the CPU benchmark row (4 layers × 128 hidden, 4 heads, micro batch 12 × seq 64, fp32, AdamW,
clip 1.0, dropout 0, mock data). Each run is a fresh process; runs alternate reference / mptrain so
that a busy shared machine slows both alike. mptrain's step time per iteration is
``tokens / tokens_per_s`` of metrics.jsonl (the trainer's own ``train_step`` wall time, which ends in
the host sync that reads the loss). Prints one JSON line per run, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(layers=4, hidden=128, heads=4, seq=64, mbs=12)


def run_reference(iters: int, warmup: int) -> float:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_reference.py"), "--iters", str(iters),
                          "--warmup", str(warmup)], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])["iter_s_median"]


def mptrain_overrides(train_iters: int, run_dir: str) -> list:
    """The Hydra overrides of this shape's mptrain run."""
    s = SHAPE
    return ["model=tiny", f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
            f"model.num_attention_heads={s['heads']}", f"model.seq_length={s['seq']}",
            f"train.micro_batch_size={s['mbs']}", f"train.global_batch_size={s['mbs']}", "optim=adamw",
            "optim.weight_decay=0.01", "train.clip_grad=1.0", f"train.train_iters={train_iters}",
            "train.eval_interval=null", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
            "run.progress_bar=false", "run.cpu_malloc_tuning=true", f"run.dir={run_dir}"]


def run_mptrain(iters: int, warmup: int, extra: list, stat=statistics.median) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, str(ROOT / "train.py"), *mptrain_overrides(iters + warmup, f"{tmp}/run"), *extra]
        subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
        rows = [json.loads(l) for l in Path(tmp, "run", "metrics.jsonl").read_text().splitlines() if l.strip()]
    tok = SHAPE["mbs"] * SHAPE["seq"]
    times = [tok / r["tokens_per_s"] for r in rows if r.get("split") == "train" and r["iteration"] > warmup]
    return stat(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ab", default=None, metavar="OVERRIDE",
                    help="instead of the reference: mptrain with and without this override, alternating "
                         "(e.g. train.manual_gc=true); reports the mean and the median step of each")
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides for mptrain")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.ab:
        ab(a)
        return
    ref, mine = [], []
    for i in range(a.runs):
        ref.append(run_reference(a.iters, a.warmup))
        mine.append(run_mptrain(a.iters, a.warmup, a.extra))
        print(json.dumps({"run": i, "reference_iter_s": round(ref[-1], 5), "mptrain_iter_s": round(mine[-1], 5)}),
              flush=True)
    r, m = statistics.median(ref), statistics.median(mine)
    print(json.dumps({"reference_iter_s_median": round(r, 5), "mptrain_iter_s_median": round(m, 5),
                      "mptrain_speed_vs_reference": round(r / m, 3), "runs": a.runs}))


def ab(a) -> None:
    """``--ab OVERRIDE``: per run, the mean and median step time of mptrain without and with OVERRIDE."""
    out = {"without": [], "with": []}
    for i in range(a.runs):
        for key, extra in (("without", a.extra), ("with", [*a.extra, a.ab])):
            out[key].append([run_mptrain(a.iters, a.warmup, extra, stat) for stat in (statistics.mean, statistics.median)])
        print(json.dumps({"run": i, **{k: [round(x, 5) for x in v[-1]] for k, v in out.items()}}), flush=True)
    means = {k: round(statistics.median(m for m, _ in v), 5) for k, v in out.items()}
    medians = {k: round(statistics.median(md for _, md in v), 5) for k, v in out.items()}
    print(json.dumps({"override": a.ab, "iter_s_mean": means, "iter_s_median": medians,
                      "speed_with_vs_without_mean": round(means["without"] / means["with"], 3),
                      "speed_with_vs_without_median": round(medians["without"] / medians["with"], 3), "runs": a.runs}))


if __name__ == "__main__":
    main()
