"""Helpers for end-to-end tests: compose a config like train.py does and run it in-process."""

from __future__ import annotations

import json
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


_REGISTERED: list = []  # whether this process registered the schemas (Hydra's ConfigStore keeps them)


def compose(overrides: list):
    """The composed config for `overrides` (as `python train.py <overrides>` would see it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from mptrain.config.schema import register

    if not _REGISTERED:  # suite time: registering builds every group's structured schema (~0.1 s a call)
        register()
        _REGISTERED.append(True)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_job(rank: int, world: int, overrides) -> dict:
    """Pool task: run one training job with `overrides` (a list, or the config `compose` made of one) on every rank;
    rank 0 returns the summary."""
    from mptrain.training.run import run

    return run(compose(overrides) if isinstance(overrides, (list, tuple)) else overrides)


def _compose_in_parent(overrides, *rest):
    """`harness.run_distributed`'s hook for `run_job`: compose once in this process and hand every rank the config
    (suite time: Hydra's compose is ~0.15 CPU-s a rank). A list that does not compose goes to the ranks as it is,
    so that a test of a composition error sees the ranks' own failure."""
    if not isinstance(overrides, (list, tuple)):
        return (overrides, *rest)
    try:
        return (compose(overrides), *rest)
    except Exception:  # noqa: BLE001 - the ranks raise it again, where the test expects it
        return (overrides, *rest)


run_job.in_parent = _compose_in_parent


# metrics.jsonl keys that time the run (they differ between equal runs)
TIMING_KEYS = ("tokens_per_s", "tflops_per_gpu", "mfu", "mem_allocated_gib")


def without_timing(rows: list) -> list:
    """`rows` less their `TIMING_KEYS`: what two runs of the same math must write alike."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def read_rows(run_dir, split: str = "train") -> list:
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def count_host_reads(monkeypatch) -> dict:
    """Count ``Tensor.tolist`` / ``Tensor.item`` calls (the host reads of a step) from now on: {"tolist", "item"}."""
    import torch

    calls = {"tolist": 0, "item": 0}
    for name in calls:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls
