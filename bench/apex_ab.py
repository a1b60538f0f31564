#!/usr/bin/env python3
"""apex A/B through the trainer on one GPU: optim.impl=torch vs apex, LayerNorm vs ApexFusedLayerNorm.

    python3 bench/apex_ab.py --out DIR [--iters 20] [--warmup 5]

Shape: 12 layers × 768, 12 heads, seq 1024, micro batch 12, bf16, mock data, AdamW, clip 1.0, dropout 0,
eager layers (apex's norm is an opaque autograd function). Runs are interleaved (A B C A B C) in fresh
processes; each prints one JSON line: the median step time after warm-up, tok/s, and the largest
|lm_loss - lm_loss of the torch/torch run| over the iterations (same seeds and data: bf16 noise only).
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"torch": [], "apex_optim": ["optim.impl=apex"], "apex_norm": ["model.normalization=ApexFusedLayerNorm"],
        "apex_both": ["optim.impl=apex", "model.normalization=ApexFusedLayerNorm"]}


def run(name, extra, out, iters, warmup, rep):
    d = Path(out) / f"{name}-{rep}"
    argv = [sys.executable, str(ROOT / "train.py"), "model=gpt_125m", "model.seq_length=1024", "precision=bf16",
            "data=mock", "data.vocab_size=50257", "optim=adamw", "optim.lr=1e-4", "optim.weight_decay=0.01",
            "train.clip_grad=1.0", "train.micro_batch_size=12", "train.global_batch_size=12",
            f"train.train_iters={iters + warmup}", "train.eval_interval=null", "run.progress_bar=false",
            f"run.dir={d}", *extra]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    (Path(out) / f"{name}-{rep}.log").write_text(p.stdout + p.stderr)
    if p.returncode:
        return {"arm": name, "rep": rep, "status": f"failed rc={p.returncode}", "tail": (p.stdout + p.stderr)[-600:]}
    rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    tok = 12 * 1024
    times = [tok / r["tokens_per_s"] for r in train if r["iteration"] > warmup]
    kernels = [l for l in (p.stdout + p.stderr).splitlines() if "optimizer:" in l][:1]
    return {"arm": name, "rep": rep, "status": "ok", "iter_s_median": statistics.median(times),
            "tokens_per_s": tok / statistics.median(times), "lm_loss": [r["lm_loss"] for r in train],
            "log": kernels}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    results = []
    for rep in range(a.reps):
        for name, extra in ARMS.items():
            r = run(name, extra, a.out, a.iters, a.warmup, rep)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "lm_loss"}), flush=True)
    base = next((r for r in results if r["arm"] == "torch" and r["status"] == "ok"), None)
    print(f"{'arm':12s} {'iter ms (median over reps)':>28s} {'tok/s':>10s} {'max |dloss| vs torch':>22s}")
    for name in ARMS:
        ok = [r for r in results if r["arm"] == name and r["status"] == "ok"]
        if not ok:
            print(f"{name:12s} failed")
            continue
        t = statistics.median(r["iter_s_median"] for r in ok)
        d = max(abs(x - y) for x, y in zip(ok[0]["lm_loss"], base["lm_loss"])) if base else None
        print(f"{name:12s} {1e3 * t:28.2f} {12 * 1024 / t:10.0f} {d!s:>22s}")
    (Path(a.out) / "apex_ab.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
