"""Seconds a checkpoint save blocks training, checkpoint.async_save=false vs true.

Runs `train.py`'s job in-process (world 1, or under torchrun) for each mode: `--iters` iterations
with a save every `--interval`, and reads the "training blocked X s" of every save from the run's
train.log (sync: `mptrain.checkpoint.api.save_checkpoint` logs it, the whole save; async:
`mptrain.training.checkpointing.Checkpointer` logs it, the wait for the previous save + the
device-to-host copy). Prints one JSON row per mode and rank 0:

    {"model", "parallel", "precision", "async_save", "blocking_s": [per save], "blocking_s_median",
     "checkpoint_bytes", "save_dir"}

CPU smoke test: `python bench/checkpoint_save_time.py --model tiny`
GPU (one H200): `python bench/checkpoint_save_time.py --model gpt_1.3b --precision bf16 --save-dir /local/nvme/ck`
Extra overrides after `--` go to the job (e.g. `-- train.micro_batch_size=1`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--parallel", default="tp1pp1")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--save-dir", default=None, help="checkpoint folder root (default: a temporary folder)")
    ap.add_argument("--cleanup", action="store_true", help="remove each mode's checkpoints once measured")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()

    from train_utils import compose

    from mptrain.groups import read_dist_env
    from mptrain.training.run import run

    rank = read_dist_env().rank
    base = Path(args.save_dir or tempfile.mkdtemp(prefix="ckbench_"))
    for async_save in (False, True):
        tag = "async" if async_save else "sync"
        ck, run_dir = base / f"ck_{tag}", base / f"run_{tag}"
        for p in (ck, run_dir):
            shutil.rmtree(p, ignore_errors=True)
        overrides = [f"model={args.model}", f"parallel={args.parallel}", f"precision={args.precision}",
                     f"train.train_iters={args.iters}", "train.eval_interval=null", "run.progress_bar=false",
                     f"checkpoint.save={ck}", f"checkpoint.save_interval={args.interval}",
                     f"checkpoint.async_save={str(async_save).lower()}", f"run.dir={run_dir}", *args.extra]
        run(compose(overrides))
        if rank != 0:
            continue
        blocked = [float(m) for m in re.findall(r"training blocked ([0-9.]+) s", (run_dir / "train.log").read_text())]
        last = ck / f"iter_{args.iters:07d}"
        nbytes = sum(f.stat().st_size for f in last.iterdir()) if last.is_dir() else None
        print(json.dumps({"model": args.model, "parallel": args.parallel, "precision": args.precision,
                          "async_save": async_save, "blocking_s": blocked,
                          "blocking_s_median": statistics.median(blocked) if blocked else None,
                          "checkpoint_bytes": nbytes, "save_dir": str(ck)}), flush=True)
        if args.cleanup:
            shutil.rmtree(ck, ignore_errors=True)  # a gpt_1.3b checkpoint is ~18 GB: keep one mode's on disk at a time


if __name__ == "__main__":
    main()
