#!/usr/bin/env python3
"""How much of the training loop Python's cyclic garbage collector takes (``train.manual_gc``'s case).

    OMP_NUM_THREADS=1 python bench/gc_in_loop.py [--iters 60] [extra Hydra overrides]

Runs the CPU benchmark shape (`bench/cpu_compare.py`'s: 4 layers × 128, micro batch 12 × 64, AdamW, fp32) in this process and
times every collection that starts inside the loop (``gc.callbacks``, from the loop's first
iteration to the end of the run). Prints one JSON line: the loop's wall seconds, the collections by
generation, the seconds spent in them and their share of the loop.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "src"), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    import tempfile

    import mptrain.training.metrics as metrics_module
    import mptrain.training.run as run_module
    from cpu_compare import mptrain_overrides
    from train_utils import compose

    spent = {"seconds": 0.0, "by_generation": [0, 0, 0]}
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent["seconds"] += time.perf_counter() - started[0]
            spent["by_generation"][info["generation"]] += 1

    rows_init = metrics_module.TrainRows.__init__
    loop_start = [0.0]

    def init(self, *args, **kwargs):  # built right before the loop's first iteration
        rows_init(self, *args, **kwargs)
        gc.callbacks.append(on_gc)
        loop_start[0] = time.perf_counter()

    metrics_module.TrainRows.__init__ = init
    with tempfile.TemporaryDirectory() as tmp:
        run_module.run(compose([*mptrain_overrides(a.iters, f"{tmp}/run"), *a.extra]))
    loop_s = time.perf_counter() - loop_start[0]
    gc.callbacks.remove(on_gc)
    print(json.dumps({"iters": a.iters, "extra": a.extra, "loop_s": round(loop_s, 3),
                      "collections_by_generation": spent["by_generation"], "gc_s": round(spent["seconds"], 4),
                      "gc_share_of_loop": round(spent["seconds"] / loop_s, 5)}))


if __name__ == "__main__":
    main()
