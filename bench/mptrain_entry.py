"""train.py for benchmarks: the same Hydra entry, plus a per-rank record of peak memory.

    torchrun --standalone --nproc_per_node=N bench/mptrain_entry.py [--bench-profile FILE] <overrides>

Runs what `train.py` runs (its command-line pre-check, `mptrain.config.cli`: an override Hydra cannot
compose is one ``error:`` line, which `fp8_convergence.py` records; then `mptrain.training.run.hydra_main`),
then every rank writes
``<run.dir>/bench_rank<R>.json``: {"rank", "peak_alloc_gib", "peak_reserved_gib"} from
`torch.cuda.max_memory_allocated` / `max_memory_reserved` (GiB = 2^30 bytes; null on CPU) — the
metrics rows carry rank 0's current allocation only, and the benchmark reports the max over ranks,
as the peer does. No collective is needed after the run (each rank writes its own file).

``--bench-profile FILE`` (stripped before Hydra sees the command line): run the job under
`torch.profiler` and write rank 0's top kernels by device time to FILE (a text table). Timings
of a profiled run are not benchmark numbers.

``--bench-inductor KEY=VALUE[,KEY=VALUE]`` (stripped likewise): set Inductor config keys
(``torch._inductor.config``, e.g. ``triton.prefer_nd_tiling=true``) before anything compiles, to A/B
Inductor's code generation on the whole trainer.

``--bench-inductor-choices stock`` (stripped likewise): leave Inductor's own heuristics in place of
`mptrain.layers.inductor_choices` (the A/B of that module; give the run its own ``TORCHINDUCTOR_CACHE_DIR``:
the handler is not part of every torch's cache key).
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
INDUCTOR = _pop_flag(sys.argv, "--bench-inductor")
CHOICES = _pop_flag(sys.argv, "--bench-inductor-choices")

from mptrain.config.schema import register  # noqa: E402  (after sys.path is final)
from profile_report import write_profile  # noqa: E402  (bench/ is the script's folder, on sys.path)

register()


def _set_inductor(pairs: str) -> None:
    """``KEY=VALUE,...`` into ``torch._inductor.config`` (values: true / false / integers / strings)."""
    import torch._inductor.config as inductor_config

    for pair in pairs.split(","):
        key, value = pair.split("=", 1)
        parsed = {"true": True, "false": False}.get(value.lower(), int(value) if value.lstrip("-").isdigit() else value)
        obj = inductor_config
        *path, leaf = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        if not hasattr(obj, leaf):
            raise SystemExit(f"--bench-inductor: torch._inductor.config has no key {key}")
        setattr(obj, leaf, parsed)


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
    with profile(activities=acts, record_shapes=True,
                 schedule=schedule(wait=PROFILE_SKIP - 1, warmup=1, active=active, repeat=1)) as prof:
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
        write_profile(PROFILE_FILE, prof.key_averages(), iterations=active, cuda=cuda,
                      what=f"{active} steady-state iterations after {PROFILE_SKIP}", events=prof.events())
    return summary


@hydra.main(version_base="1.3", config_path=str(ROOT / "conf"), config_name="config")
def main(cfg):
    """train.py's task function plus the peak record; returns the job's summary (a sweep's summary.md records it)."""
    from mptrain.training.run import hydra_main

    if INDUCTOR:
        _set_inductor(INDUCTOR)
    if CHOICES == "stock":
        from mptrain.layers import inductor_choices

        inductor_choices.install = lambda: "stock"
    elif CHOICES is not None:
        raise SystemExit(f"--bench-inductor-choices: {CHOICES!r} is not 'stock'")
    summary = _run_profiled(cfg, hydra_main) if PROFILE_FILE else hydra_main(cfg)
    _write_peak((summary or {}).get("run_dir") or cfg.run.dir)
    return summary


if __name__ == "__main__":
    from mptrain.config.cli import exit_on_compose_error

    exit_on_compose_error(str(ROOT / "conf"))
    main()
