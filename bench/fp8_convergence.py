#!/usr/bin/env python3
"""FP8 against bf16 on real text: the final validation loss of each, same recipe, several seeds, one call.

    python3 bench/fp8_convergence.py [--seeds 1234,2,3] [--recipe tensorwise] [--jobs N] [--out FILE] [--emulate] [-- overrides]

gpt_125m size on the shipped Shakespeare corpus (byte-level tokenizer), sequences of 1024, 2 per step,
2,000 iterations: 4.1 M tokens, under one epoch of the train split, so the validation loss measures
generalisation rather than how a second pass over 5 MB is memorised (past one epoch, runs of equal precision
spread by 4-9 %: bench/reports/2026-12-03-remaining-rows-and-fp8-convergence.md). Cosine lr 6e-4 → 6e-5 after
100 warm-up iterations, AdamW, clip 1.0; evaluation every 500 iterations on 50 batches; the fp8 arm with every
block GEMM in FP8 (``precision.fp8_gemm_filter=none``: at width 768 the size rule would keep proj and fc2 in bf16).

Arms run interleaved by seed (bf16 seed 1, fp8 seed 1, bf16 seed 2, ...), ``--jobs`` at a time, each as
``torchrun --nproc_per_node=1 bench/mptrain_entry.py`` into its own run folder. Prints (and with ``--out``
appends) one JSON row per run: precision, seed, run folder, command, validation lm_loss at each evaluation (or the
run's ``error:`` line); exit 1 when a run failed; then a summary row:
the mean final validation loss of each arm, fp8 / bf16, and the spread (max - min) / mean of each arm's finals,
which says whether a 1 % difference can be resolved. Overrides after ``--`` apply to every run (a CPU smoke run:
``--emulate -- model=tiny model.seq_length=64 train.train_iters=4 train.eval_interval=2 train.eval_iters=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from train_utils import read_rows  # noqa: E402  (tests/ holds the metrics.jsonl reader)
RECIPE = ["model=gpt_125m", "model.vocab_size=null", "data=shakespeare", "model.seq_length=1024",
          "train.micro_batch_size=2", "train.global_batch_size=2", "train.train_iters=2000",
          "train.eval_interval=500", "train.eval_iters=50", "optim=adamw", "optim.lr=6e-4", "optim.min_lr=6e-5",
          "optim.lr_warmup_iters=100", "optim.lr_decay_iters=2000", "optim.lr_decay_style=cosine",
          "train.clip_grad=1.0", "run.progress_bar=false"]


def valid_losses(run_dir: Path) -> dict:
    """{iteration: validation lm_loss} from a run's metrics.jsonl."""
    return {r["iteration"]: r["lm_loss"] for r in read_rows(run_dir, "valid")}


def run_arm(precision: str, seed: int, recipe: str, root: Path, extra: list, emulate: bool = False) -> dict:
    run_dir = root / f"{precision}_seed{seed}"
    prec = [f"precision={precision}"]
    if precision == "fp8":  # every block GEMM in FP8, as the earlier convergence runs (the size rule keeps some bf16)
        prec += [f"precision.fp8_recipe={recipe}", "precision.fp8_gemm_filter=none"]
        prec += ["precision.fp8_emulate=true"] if emulate else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "bench" / "mptrain_entry.py"), *RECIPE, *prec, f"train.seed={seed}", f"run.dir={run_dir}", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    row = {"precision": precision, "recipe": recipe if precision == "fp8" else None, "seed": seed,
           "status": "ok" if out.returncode == 0 else f"exit {out.returncode}", "run_dir": str(run_dir),
           "command": "python3 " + " ".join(cmd[1:]).replace(str(ROOT) + "/", "")}
    if out.returncode != 0:  # the trainer's own `error:` line, which torchrun's failure report would push out of a tail
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        row["error"] = errors[0] if errors else out.stderr[-1500:]
        return row
    losses = valid_losses(run_dir)
    if not losses:  # ended without an evaluation (e.g. an override that turned it off): a failed arm, not a crash
        row.update(status="no validation rows", error=f"{run_dir}/metrics.jsonl has no valid rows")
        return row
    row["valid_lm_loss"] = {str(k): v for k, v in sorted(losses.items())}
    row["final_valid_lm_loss"] = losses[max(losses)]
    return row


def summary(rows: list) -> dict:
    finals = {p: [r["final_valid_lm_loss"] for r in rows if r["precision"] == p and r["status"] == "ok"]
              for p in ("bf16", "fp8")}
    out = {"summary": True}
    for p, values in finals.items():
        if values:
            mean = statistics.fmean(values)
            out[p] = {"mean_final": round(mean, 5), "finals": values, "spread": round((max(values) - min(values)) / mean, 4)}
    if finals["bf16"] and finals["fp8"]:
        out["fp8_over_bf16"] = round(out["fp8"]["mean_final"] / out["bf16"]["mean_final"], 5)
    return out


def emit(row: dict, out: str | None) -> None:
    """Print one JSON row and append it to ``out`` when given."""
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    from mptrain.layers.fp8 import FP8_RECIPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1234,2,3", help="train.seed of each pair of runs (default: %(default)s)")
    ap.add_argument("--recipe", default="tensorwise", choices=FP8_RECIPES, help="the fp8 arm's precision.fp8_recipe")
    ap.add_argument("--out", default=None, help="append the rows to this JSONL file")
    ap.add_argument("--root", default=None, help="the folder of the run folders (default: a new temporary one)")
    ap.add_argument("--emulate", action="store_true", help="the fp8 arm with precision.fp8_emulate=true (CPU)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once on the one device (default: %(default)s)")
    ap.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    a = ap.parse_args()
    if a.jobs < 1:
        ap.error(f"--jobs={a.jobs} must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="fp8_conv_"))
    print(f"# run folders under {root}", flush=True)
    arms = [(precision, int(seed)) for seed in a.seeds.split(",") for precision in ("bf16", "fp8")]
    rows = []
    # Runs of a 125M model at 2 x 1024 tokens a step leave most of an H200 idle: --jobs runs several at once
    # (each arm's loss does not depend on its speed); rows are written as runs end, so a cut-off call keeps them.
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = [pool.submit(run_arm, p, seed, a.recipe, root, a.extra, a.emulate) for p, seed in arms]
        for future in as_completed(futures):
            rows.append(future.result())
            emit(rows[-1], a.out)
    rows.sort(key=lambda r: (r["seed"], r["precision"]))
    emit(summary(rows), a.out)
    sys.exit(0 if all(r["status"] == "ok" for r in rows) else 1)  # a failed run: exit 1 (its row says why)


if __name__ == "__main__":
    main()
