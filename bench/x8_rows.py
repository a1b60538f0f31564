"""Run several training configs one after another in one torchrun launch (the CPU dry run of `bench/x8.py`).

    torchrun --standalone --nproc_per_node=N bench/x8_rows.py ROWS.json

ROWS.json: a list of {"name", "run_dir", "overrides"} (the overrides `bench/mptrain_entry.py` would get).
Each row is composed from conf/ as `train.py` composes it and trained by `mptrain.training.run.run`, which
builds and destroys its own process groups and leaves the default one up (as a sweep's jobs do), so Python
and torch start once for all rows of a world size. Every rank then writes ``<run_dir>/bench_rank<R>.json``
(`mptrain_entry.py`'s peak-memory record; null on CPU). A row that raises is printed with its name and the
launch goes on to the next row (a config error is raised on every rank alike); exit status 1 if any failed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compose(overrides: list):
    """conf/config.yaml with ``overrides`` (Hydra's compose API; the schemas registered)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from mptrain.config.schema import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def main(spec: str) -> int:
    import torch.distributed as dist

    from mptrain.training.run import run

    rank = int(os.environ.get("RANK", "0"))
    failed = 0
    for row in json.loads(Path(spec).read_text()):
        if rank == 0:
            print(f"=== row {row['name']}: {' '.join(row['overrides'])}", flush=True)
        try:
            summary = run(compose(row["overrides"]))
        except Exception:  # noqa: BLE001 -- the row's failure is its result; the next row still runs
            failed += 1
            print(f"=== row {row['name']} FAILED on rank {rank}:\n{traceback.format_exc()}", flush=True)
            continue
        run_dir = (summary or {}).get("run_dir") or row["run_dir"]
        Path(run_dir, f"bench_rank{rank}.json").write_text(
            json.dumps({"rank": rank, "peak_alloc_gib": None, "peak_reserved_gib": None}) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
