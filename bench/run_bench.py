#!/usr/bin/env python3
"""Run mptrain and the megatron-core peer on the same configs in one run; append JSON rows.

    python3 bench/run_bench.py --suite quick|full|ceiling|small|fp8|moe|x8|zero --out $OUT/results.jsonl --call-id ID \
        [--gpus N] [--only NAME,...] [--budget-s 560] [--profile [VARIANTS]] [--dry-run]
        [--plan] [--call K] [--dry-run-cpu]

``--plan`` splits the selected jobs into GPU jobs by estimated seconds and prints them, ``--call K`` runs
the K-th, ``--dry-run-cpu`` runs the selected rows' first steps on CPU with a stand-in model (`bench/x8.py`).
A row whose override names a key the config schema lacks is recorded as ``needs: <key>`` without running.

For each config of `bench/configs.py` (in priority order) it runs
  * mptrain: ``torchrun --standalone --nproc_per_node=N bench/mptrain_entry.py <overrides>`` (train.py
    plus a per-rank peak-memory record), once per variant (``base``, ``compile`` = model.compile_layers);
  * the peer: ``torchrun ... bench/peer/peer_megatron.py <args>`` with the same shape, layout, batch,
    warm-up and timed iterations;
and appends one row per run to ``--out`` (keys: trainer, config, variant, gpus, gpu_name, call_id,
tokens_per_s_per_gpu, tflops_per_gpu, mfu, peak_mem_gib, status, + versions, layout, iteration times).
``full`` also probes which SDPA kernel runs for each attention shape (``sdpa_probe.jsonl`` beside
``--out``) and runs the compiled plain-PyTorch reference (`bench/peer/torch_ceiling.py`) after
config (b). Logs and run folders go under ``<dir of --out>/bench_logs``. Runs that do not fit in
``--budget-s`` (e.g. a GPU lease capped at 600 s) are recorded with status "skipped".

Throughput of mptrain: rank 0's per-iteration ``tokens_per_s`` from metrics.jsonl (each step ends
with a host sync for the loss), warm-up iterations dropped, mean iteration time = Σ T / tokens_per_s_i
/ iters. FLOPs, TFLOP/s and MFU are recomputed here with DESIGN.md §2's formula for both trainers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from configs import (  # noqa: E402
    MOE_PRESETS, PEAK_TFLOPS_BF16_DENSE, VARIANTS, BenchConfig, flops_per_iteration, moe_reference_env,
    mptrain_overrides, peer_args, reference_env, reference_variants, suite,
    variant_env, variant_flags, variant_precision)
from x8 import (  # noqa: E402
    cpu_config, does_not_fit, job_needs, planner_prediction, print_plan, run_cpu, split_calls)

# NVLink multicast must stay off on the lent hosts (KINDS.md); set for every child process.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TRAINERS = ("mptrain", "megatron-core")
MODEL_LAYERS = {"moe_mixtral_small": 12}  # MoE layers of an MoE preset (every layer: moe_layer_freq 1)
CEILING_CONFIG = "ceiling_gpt1.3b_tp1"


# --------------------------------------------------------------------------------------- rows
def _round(x: Optional[float], nd: int) -> Optional[float]:
    return None if x is None else round(float(x), nd)


def _mfu(tflops_per_gpu: float, gpu_name: str) -> Optional[float]:
    """TFLOP/s over the dense bf16 peak (989 on H100/H200); None for other devices."""
    if not any(k in (gpu_name or "") for k in ("H100", "H200")):
        return None
    return tflops_per_gpu / PEAK_TFLOPS_BF16_DENSE


def base_row(cfg: BenchConfig, *, trainer: str, variant: str, env: dict, call_id: str) -> dict:
    """The identifying fields every row shares (numbers null until filled)."""
    s = cfg.shape
    return {
        "trainer": trainer, "config": cfg.name, "variant": variant, "gpus": cfg.gpus,
        "gpu_name": env.get("gpu_name"), "call_id": call_id,
        "tokens_per_s_per_gpu": None, "tflops_per_gpu": None, "mfu": None, "peak_mem_gib": None,
        "status": "ok", "model": cfg.model, "layout": cfg.layout, "precision": variant_precision(cfg, variant), "tf32": cfg.tf32,
        "micro_batch_size": cfg.micro_batch_size, "num_microbatches": cfg.num_microbatches,
        "global_batch_size": cfg.global_batch_size, "seq_length": s.seq_length,
        "tokens_per_iter": cfg.tokens_per_iteration, "flops_per_iter": flops_per_iteration(cfg),
        "warmup_iters": cfg.warmup, "timed_iters": cfg.iters,
        "torch": env.get("torch"), "cuda": env.get("cuda"), "nccl": env.get("nccl"),
        "megatron_core": env.get("megatron_core"), "time_utc": env.get("time_utc"),
    }


def _fill_rates(row: dict, cfg: BenchConfig, iter_s: float) -> dict:
    tflops = flops_per_iteration(cfg) / iter_s / cfg.gpus / 1e12
    mfu = _mfu(tflops, row["gpu_name"])
    row.update(iter_s_mean=_round(iter_s, 5), tokens_per_s_per_gpu=_round(cfg.tokens_per_iteration / iter_s / cfg.gpus, 1),
               tflops_per_gpu=_round(tflops, 2), mfu=_round(mfu, 4))
    return row


def mptrain_row(cfg: BenchConfig, variant: str, metrics_rows: list, peaks: list, *, env: dict, call_id: str) -> dict:
    """A row from mptrain's metrics.jsonl rows and the per-rank peak records of `mptrain_entry.py`.

    The first ``cfg.warmup`` iterations are dropped; the next ``cfg.iters`` are timed.
    Raises:
        ValueError: fewer timed train rows than ``cfg.iters``, or a row without tokens_per_s.
    """
    row = base_row(cfg, trainer="mptrain", variant=variant, env=env, call_id=call_id)
    train = sorted((r for r in metrics_rows if r.get("split") == "train"), key=lambda r: r["iteration"])
    timed = [r for r in train if r["iteration"] > cfg.warmup][: cfg.iters]
    if len(timed) < cfg.iters or any(not r.get("tokens_per_s") for r in timed):
        raise ValueError(f"{cfg.name}/{variant}: {len(timed)} timed train rows with tokens_per_s, expected {cfg.iters}")
    times = [cfg.tokens_per_iteration / r["tokens_per_s"] for r in timed]  # seconds per iteration (rank 0)
    _fill_rates(row, cfg, sum(times) / len(times))
    if len(times) > 1:  # less the last row: its period also holds the device work queued by the one before
        steady = sum(times[:-1]) / (len(times) - 1)
        tflops = flops_per_iteration(cfg) / steady / cfg.gpus / 1e12
        mfu = _mfu(tflops, row["gpu_name"])
        row.update(tokens_per_s_per_gpu_steady=_round(cfg.tokens_per_iteration / steady / cfg.gpus, 1),
                   mfu_steady=_round(mfu, 4) if mfu is not None else None)
    allocs = [p["peak_alloc_gib"] for p in peaks if p.get("peak_alloc_gib") is not None]
    row.update(
        iter_s_median=_round(sorted(times)[len(times) // 2], 5), iter_s_min=_round(min(times), 5),
        iter_s_max=_round(max(times), 5),
        peak_mem_gib=_round(max(allocs), 2) if allocs else None,
        peak_alloc_gib_per_rank=[_round(p.get("peak_alloc_gib"), 2) for p in sorted(peaks, key=lambda p: p["rank"])],
        loss_first_last=[train[0].get("lm_loss"), train[-1].get("lm_loss")] if train else None,
        lm_loss=[_round(r.get("lm_loss"), 6) for r in train],
    )
    row.update(skip_record(train))
    theirs = [r["tflops_per_gpu"] for r in timed if r.get("tflops_per_gpu")]
    # the trainer's own TFLOP/s (same formula): a cross-check of the recomputed number, not used in it
    row["metrics_tflops_per_gpu_mean"] = _round(sum(theirs) / len(theirs), 2) if theirs else None
    return row


def skip_record(train: list) -> dict:
    """The loss scaler's skipped iterations of a run's train rows and what the 8-GPU table asks of them:
    ``skipped_iters`` (iteration numbers), ``skips_only_at_start`` (every skipped iteration precedes every
    stepped one) and ``loss_falls`` (the last stepped iteration's lm_loss below the first's; None with fewer
    than 2 stepped iterations)."""
    skipped = [r["iteration"] for r in train if r.get("skipped_iter")]
    stepped = [r for r in train if not r.get("skipped_iter") and r.get("lm_loss") is not None]
    only_at_start = not skipped or not stepped or max(skipped) < min(r["iteration"] for r in stepped)
    falls = stepped[-1]["lm_loss"] < stepped[0]["lm_loss"] if len(stepped) > 1 else None
    return {"skipped_iters": skipped, "skips_only_at_start": only_at_start, "loss_falls": falls}


def compare_baseline(row: dict, job: dict, ours: dict) -> None:
    """``baseline_config`` and ``vs_baseline`` (tokens/s/GPU ÷ the baseline's, same variant, same call: the weak-
    scaling efficiency, or an EP row against ep 1) of a row whose config names a `BenchConfig.baseline`;
    ``vs_baseline`` None when the baseline has no row of this call."""
    cfg = next((c for c in job.get("cfgs") or [job["cfg"]] if c is not None and c.name == row["config"]), None)
    if cfg is None or not cfg.baseline:
        return
    ref = ours.get((cfg.baseline, row["variant"]))
    ratio = row["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"] if ref and ref.get("tokens_per_s_per_gpu") else None
    row.update(baseline_config=cfg.baseline, vs_baseline=_round(ratio, 4))


def compare_losses(row: dict, reference: Optional[dict]) -> None:
    """Add ``loss_max_abs_diff_vs_base``: how far a variant's per-iteration lm_loss is from the ``base``
    variant's (eager) of the same config in the same call. Left out without a reference (and on the
    base row itself); None when no iteration has both losses. Every variant is the same math, so a
    difference far above the precision's noise means a broken variant."""
    ref = (reference or {}).get("lm_loss")
    mine = row.get("lm_loss")
    if not ref or not mine or row is reference:
        return
    pairs = [(a, b) for a, b in zip(mine, ref) if a is not None and b is not None]
    row["loss_max_abs_diff_vs_base"] = _round(max(abs(a - b) for a, b in pairs), 6) if pairs else None


def peer_row(cfg: BenchConfig, result: dict, *, env: dict, call_id: str) -> dict:
    """A row from one JSON result line of `bench/peer/peer_megatron.py` (its iter_s_mean, peak memory)."""
    row = base_row(cfg, trainer="megatron-core", variant="base", env=env, call_id=call_id)
    _fill_rates(row, cfg, float(result["iter_s_mean"]))
    row.update(
        iter_s_median=result.get("iter_s_median"), iter_s_min=result.get("iter_s_min"), iter_s_max=result.get("iter_s_max"),
        peak_mem_gib=_round(result.get("peak_alloc_gib_max"), 2),
        peak_alloc_gib_per_rank=result.get("peak_alloc_gib_per_rank"), loss_first_last=result.get("loss_first_last"),
        peer_tokens_per_s_per_gpu=result.get("tokens_per_s_per_gpu"), optimizer=result.get("optimizer"),
    )
    for key in ("torch", "cuda", "nccl", "megatron_core"):
        row[key] = result.get(key, row[key])
    return row


def ceiling_row(result: dict, *, env: dict, call_id: str) -> dict:
    """A row from one JSON line of `bench/peer/torch_ceiling.py` (gpt_1.3b shape, 1 GPU, mbs 4 × 4)."""
    return {
        "trainer": "torch-ceiling", "config": CEILING_CONFIG, "variant": result["name"], "gpus": 1,
        "gpu_name": env.get("gpu_name"), "call_id": call_id,
        "tokens_per_s_per_gpu": _round(result["tokens_per_s"], 1), "tflops_per_gpu": _round(result["tflops"], 2),
        "mfu": _round(result["mfu"], 4), "peak_mem_gib": _round(result["peak_gib"], 2), "status": "ok",
        "iter_s_mean": _round(result["iter_s"], 5), "torch": result.get("torch"), "time_utc": env.get("time_utc"),
    }


def reference_row(cfg: BenchConfig, result: dict, *, env: dict, call_id: str) -> dict:
    """A ``torch-reference`` row: `torch_ceiling.py` at `cfg`'s shape and batch, FLOPs by the same formula."""
    row = base_row(cfg, trainer="torch-reference", variant=result["name"], env=env, call_id=call_id)
    _fill_rates(row, cfg, float(result["iter_s"]))
    row.update(peak_mem_gib=_round(result.get("peak_gib"), 2), loss_first_last=[None, result.get("loss")],
               clip=result.get("clip"), torch=result.get("torch", row["torch"]))
    return row


def failed_row(cfg: Optional[BenchConfig], *, trainer: str, variant: str, env: dict, call_id: str, status: str,
               detail: str) -> dict:
    """A row for a run that failed, timed out or was skipped (numbers null)."""
    if cfg is None:
        row = {"trainer": trainer, "config": CEILING_CONFIG, "variant": variant, "gpus": 1, "gpu_name": env.get("gpu_name"),
               "call_id": call_id, "tokens_per_s_per_gpu": None, "tflops_per_gpu": None, "mfu": None, "peak_mem_gib": None}
    else:
        row = base_row(cfg, trainer=trainer, variant=variant, env=env, call_id=call_id)
    row.update(status=status, detail=detail[-500:])
    return row


def failed_rows(job: dict, *, env: dict, call_id: str, status: str, detail: str) -> list:
    """`failed_row` for each config of `job` (a sweep has several)."""
    return [failed_row(cfg, trainer=job["trainer"], variant=job["variant"], env=env, call_id=call_id, status=status,
                       detail=detail) for cfg in job.get("cfgs") or [job["cfg"]]]


# --------------------------------------------------------------------------------------- plan
def torchrun(python: str, nproc: int, script: Path, args: list) -> list:
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]


def plan(configs: list, *, suite_name: str, log_dir: Path, python: str, trainers: tuple, profile: tuple = (),
         probe: bool = True, reference: bool = True) -> list:
    """The jobs in run order: dicts {kind, cfg, trainer, variant, argv, run_dir, result_file, log, timeout_s}.
    ``probe``: start the full suite with the SDPA probe (off for a partial ``--only`` call);
    ``reference``: run the plain-PyTorch reference of the configs that have one."""
    jobs = []
    if suite_name == "full" and probe:
        jobs.append(dict(kind="probe", cfg=None, trainer="sdpa-probe", variant="-", timeout_s=90,
                         argv=[python, str(HERE / "run_bench.py"), "--probe-sdpa", str(log_dir / "sdpa_probe.jsonl")]))
    if suite_name == "ceiling":
        jobs.append(dict(kind="ceiling", cfg=None, trainer="torch-ceiling", variant="all", timeout_s=420,
                         argv=[python, str(HERE / "peer" / "torch_ceiling.py")]))
    swept: set = set()
    for cfg in configs:
        if cfg.sweep:  # the sweep's configs as one `-m` job per variant, then their peers
            if cfg.sweep in swept:
                continue
            swept.add(cfg.sweep)
            group = [c for c in configs if c.sweep == cfg.sweep]
            if "mptrain" in trainers:
                jobs += [sweep_job(group, variant, python=python, log_dir=log_dir) for variant in cfg.variants]
            if "megatron-core" in trainers:
                jobs += [peer_job(c, python=python, log_dir=log_dir) for c in group if c.peer]
            continue
        if "mptrain" in trainers:
            for variant in cfg.variants:
                tag = f"{cfg.name}-{variant}"
                run_dir = log_dir / "runs" / tag
                args = variant_flags(variant) + mptrain_overrides(cfg, variant, str(run_dir))
                # compiled variants (every one on CUDA but the eager ones) get the compile time on top
                timeout_s = cfg.timeout_s + (0 if "model.compile_layers=false" in VARIANTS[variant] else 90)
                jobs.append(dict(kind="mptrain", cfg=cfg, trainer="mptrain", variant=variant, run_dir=run_dir,
                                 timeout_s=timeout_s, env=variant_env(variant),
                                 argv=torchrun(python, cfg.gpus, HERE / "mptrain_entry.py", args)))
                if variant in profile or variant in cfg.profile:  # a separate run: a profiled run's timings are not benchmark numbers
                    prof_args = variant_flags(variant) + mptrain_overrides(cfg, variant, str(run_dir) + "-profile")
                    prof_file = log_dir / f"profile_{tag}.txt"
                    jobs.append(dict(kind="profile", cfg=cfg, trainer="mptrain-profile", variant=variant,
                                     timeout_s=timeout_s, env=variant_env(variant), profile_file=prof_file,
                                     argv=torchrun(python, cfg.gpus, HERE / "mptrain_entry.py",
                                                   ["--bench-profile", str(prof_file), *prof_args])))
        if cfg.reference and reference:  # the compiled plain-PyTorch GPT at this shape, right after mptrain
            moe = cfg.preset in MOE_PRESETS  # the plain-PyTorch MoE GPT (`bench/peer/torch_moe.py`)
            script = HERE / "peer" / ("torch_moe.py" if moe else "torch_ceiling.py")
            for ref_variant in reference_variants(cfg):
                jobs.append(dict(kind="reference", cfg=cfg, trainer="torch-reference", variant=ref_variant,
                                 timeout_s=cfg.timeout_s + (60 if "fp8" in ref_variant else 0),
                                 env=moe_reference_env(cfg) if moe else reference_env(cfg),
                                 argv=[python, str(script), ref_variant]))
        if cfg.moe_share:  # the MoE layer's routing + permutation time at this shape (one micro-batch)
            m = moe_reference_env(cfg)
            share_args = ["--tokens", str(cfg.micro_batch_size * cfg.shape.seq_length), "--hidden", m["HIDDEN"],
                          "--ffn", m["EXPERT_FFN"], "--experts", m["EXPERTS"], "--topk", m["TOPK"]]
            jobs.append(dict(kind="moe_share", cfg=cfg, trainer="mptrain-moe-share", variant="compiled", timeout_s=150,
                             argv=[python, str(HERE / "moe_share.py"), *share_args]))
        if "megatron-core" in trainers and cfg.peer:
            jobs.append(peer_job(cfg, python=python, log_dir=log_dir))
        if suite_name == "full" and cfg.name.startswith("b_"):  # the compiled reference right after config (b)
            jobs.append(dict(kind="ceiling", cfg=None, trainer="torch-ceiling", variant="compile_amp", timeout_s=200,
                             argv=[python, str(HERE / "peer" / "torch_ceiling.py"), "compile_amp"]))
    for i, job in enumerate(jobs):
        job["log"] = log_dir / f"{i:02d}_{job['trainer']}_{job['cfg'].name if job['cfg'] else job['kind']}_{job['variant']}.log"
        job["needs"] = job_needs(job)
    return jobs


def peer_job(cfg: BenchConfig, *, python: str, log_dir: Path) -> dict:
    """The megatron-core job of `cfg`."""
    result_file = log_dir / f"peer_{cfg.name}.jsonl"
    return dict(kind="peer", cfg=cfg, trainer="megatron-core", variant="base", result_file=result_file,
                timeout_s=cfg.timeout_s,
                argv=torchrun(python, cfg.gpus, HERE / "peer" / "peer_megatron.py", peer_args(cfg, str(result_file))))


def sweep_dir(root: Path, cfg: BenchConfig) -> Path:
    """A sweep job's folder: ``<root>/parallel=<option>`` (the swept key, DESIGN.md §2)."""
    return root / f"parallel=tp{cfg.tp}pp{cfg.pp}"


def sweep_job(group: list, variant: str, *, python: str, log_dir: Path) -> dict:
    """One ``train.py -m ... parallel=A,B,..`` job (`bench/mptrain_entry.py`) over the layouts of `group`, which
    differ in tp and pp only; the schedule is left to ``auto`` (1F1B with pp > 1)."""
    first = group[0]
    same = [dataclasses.replace(c, name=first.name, tp=first.tp, pp=first.pp) for c in group]
    if any(c != same[0] for c in same):
        raise ValueError(f"sweep {first.sweep}: its configs differ in more than tp and pp")
    root = log_dir / "runs" / f"{first.sweep}-{variant}"
    layouts = ",".join(f"tp{c.tp}pp{c.pp}" for c in group)
    args = [("parallel=" + layouts if a.startswith("parallel=") else a)
            for a in mptrain_overrides(first, variant, str(root)) if not a.startswith("schedule=")]
    timeout_s = sum(c.timeout_s for c in group) + (0 if "model.compile_layers=false" in VARIANTS[variant] else 90)
    return dict(kind="sweep", cfg=first, cfgs=group, trainer="mptrain", variant=variant, run_dir=root,
                timeout_s=timeout_s, env=variant_env(variant),
                argv=torchrun(python, first.gpus, HERE / "mptrain_entry.py", ["-m", *variant_flags(variant), *args]))


# --------------------------------------------------------------------------------------- running
def portable_command(argv: list, *, python: str, out_dir: Path) -> str:
    """The command line as a row records it: ``python3`` for the interpreter, paths relative to the
    repository root (``bench/...``) and to ``--out``'s folder (run folders), so that rows carry no
    machine's paths."""
    roots = [str(r) + os.sep for r in (out_dir, ROOT) if r.is_absolute()]
    words = []
    for a in argv:
        for root in roots:
            a = a.replace(root, "")
        words.append(a)
    return " ".join("python3" if a == python else w for a, w in zip(argv, words))


def child_env() -> dict:
    env = dict(os.environ)
    env.update(SAFE_ENV)
    env.setdefault("OMP_NUM_THREADS", "4")
    env["PYTHONUNBUFFERED"] = "1"
    src = str(ROOT / "src")
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts + ([src] if src not in parts else []))
    return env


def run_process(argv: list, log: Path, timeout_s: float, extra_env: Optional[dict] = None) -> tuple:
    """Run argv in its own process group with output to `log`; (returncode or None on timeout, seconds)."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**child_env(), **(extra_env or {})},
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait_s)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc = None
    return rc, time.time() - t0


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if "Warning" not in l and l.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def collect(job: dict, *, env: dict, call_id: str) -> list:
    """The rows of a finished job (raises on unreadable output)."""
    cfg, kind = job["cfg"], job["kind"]
    if kind == "mptrain":
        run_dir = Path(job["run_dir"])
        rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
        peaks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("bench_rank*.json"))]
        return [mptrain_row(cfg, job["variant"], rows, peaks, env=env, call_id=call_id)]
    if kind == "sweep":  # one row per layout: its job folder, or a failed row where it has none
        rows = []
        for c in job["cfgs"]:
            d = sweep_dir(Path(job["run_dir"]), c)
            try:
                metrics = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
                peaks = [json.loads(p.read_text()) for p in sorted(d.glob("bench_rank*.json"))]
                rows.append(mptrain_row(c, job["variant"], metrics, peaks, env=env, call_id=call_id))
            except (OSError, ValueError) as err:
                rows.append(failed_row(c, trainer="mptrain", variant=job["variant"], env=env, call_id=call_id,
                                       status="failed", detail=repr(err)))
        summary = Path(job["run_dir"]) / "summary.md"
        if summary.exists():
            rows[0]["sweep_summary"] = summary.read_text()
        return rows
    if kind == "peer":
        lines = [l for l in Path(job["result_file"]).read_text().splitlines() if l.strip()]
        return [peer_row(cfg, json.loads(lines[-1]), env=env, call_id=call_id)]
    if kind == "reference":
        out = [json.loads(l) for l in job["log"].read_text().splitlines() if l.startswith("{")]
        return [reference_row(cfg, out[-1], env=env, call_id=call_id)]
    if kind == "ceiling":
        out = [json.loads(l) for l in job["log"].read_text().splitlines() if l.startswith("{")]
        return [ceiling_row(r, env=env, call_id=call_id) for r in out]
    if kind == "moe_share":
        out = [json.loads(l) for l in job["log"].read_text().splitlines() if l.startswith("{")]
        return [moe_share_row(cfg, out[-1], env=env, call_id=call_id)]
    return []


def moe_share_row(cfg: BenchConfig, result: dict, *, env: dict, call_id: str) -> dict:
    """A ``mptrain-moe-share`` row from `bench/moe_share.py`'s JSON line (one MoE layer, one micro-batch); the
    share of the step is added by `share_of_step` once the config's mptrain row of the call is known."""
    row = base_row(cfg, trainer="mptrain-moe-share", variant="compiled", env=env, call_id=call_id)
    row.update({k: result.get(k) for k in ("layer_ms", "experts_ms", "routing_ms", "routing_share_of_layer",
                                           "compile_mode", "cudagraph_skips", "routing_device_ms",
                                           "eager_forward_region_ms", "kernel", "shape")})
    return row


def share_of_step(row: dict, ours: dict) -> None:
    """``routing_share_of_step``: routing + permutation ms of one layer and micro-batch × MoE layers × micro-batches
    ÷ the same config's mptrain ``default`` step (mean iteration) of this call; None without that row."""
    step = (ours.get((row["config"], "default")) or {}).get("iter_s_mean")
    layers = MODEL_LAYERS.get(row["model"])
    if step and layers and row.get("routing_ms") is not None:
        routing_s = row["routing_ms"] / 1e3 * layers * row["num_microbatches"]
        row.update(step_s=step, routing_share_of_step=_round(routing_s / step, 4))


def prediction_of(row: dict, job: dict, prediction: dict, predict: bool) -> dict:
    """The planner's columns of one row: the job's own prediction, or for a sweep's layout row its config's."""
    if not predict or row["trainer"] != "mptrain":
        return {}
    if job["kind"] == "sweep":
        return planner_prediction(next(c for c in job["cfgs"] if c.name == row["config"]), job["variant"])
    return prediction


def environment(python: str) -> dict:
    """GPU name and software versions, read in a child process (the parent never touches CUDA)."""
    code = (
        "import json, sys, torch\n"
        "d = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "     'gpu_count': torch.cuda.device_count()}\n"
        "if torch.cuda.is_available():\n"
        "    d['gpu_name'] = torch.cuda.get_device_name(0); d['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))\n"
        "    d['gpu_mem_gib'] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)\n"
        "for mod in ('megatron.core', 'hydra', 'omegaconf'):\n"
        "    try:\n"
        "        m = __import__(mod, fromlist=['x']); d[mod.split('.')[-1] if mod != 'megatron.core' else 'megatron_core'] = getattr(m, '__version__', '?')\n"
        "    except Exception as e:\n"
        "        d[mod.replace('.', '_')] = None; d.setdefault('missing', []).append(mod)\n"
        "print(json.dumps(d))\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, env=child_env(), cwd=ROOT)
        env = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as err:  # noqa: BLE001 -- reported, not fatal
        env = {"error": repr(err)}
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.split()[0]
    except Exception:  # noqa: BLE001
        env["driver"] = None
    try:
        env["git_rev"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_rev"] = None
    env["time_utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return env


def detect_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return sum(1 for l in out.splitlines() if l.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return 0


# --------------------------------------------------------------------------------------- SDPA probe
def probe_sdpa(out_file: str) -> None:
    """Which SDPA backends run fwd+bwd for the benchmark shapes (per-TP-rank heads), and their times (ms).

    Writes one JSON line per (shape, dtype) to `out_file`: {"shape", "dtype", "backends": {name: ms
    or "error: ..."}, "default_ms", "default_kernels": device kernels of the default call}.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes = {"seed_2.8b tp2 (hd 512)": (8, 4, 1024, 512), "gpt_1.3b (hd 128)": (4, 16, 2048, 128)}
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}

    def fwd_bwd(q, k, v):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def timed(fn, *a) -> float:
        fn(*a)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn(*a)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 5

    with open(out_file, "a") as f:
        for label, (b, nh, s, hd) in shapes.items():
            for dtype in (torch.bfloat16, torch.float32):
                q, k, v = (torch.randn(b, nh, s, hd, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                rec = {"shape": label, "b_heads_s_hd": [b, nh, s, hd], "dtype": str(dtype).replace("torch.", ""),
                       "backends": {}}
                for name, backend in backends.items():
                    try:
                        with sdpa_kernel([backend]):
                            rec["backends"][name] = round(timed(fwd_bwd, q, k, v), 3)
                    except Exception as err:  # noqa: BLE001 -- "not supported for this shape" is the answer
                        rec["backends"][name] = "error: " + str(err).splitlines()[0][:160]
                rec["default_ms"] = round(timed(fwd_bwd, q, k, v), 3)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    fwd_bwd(q, k, v)
                    torch.cuda.synchronize()
                kernels = sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})
                rec["default_kernels"] = [kname[:100] for kname in kernels][:12]
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")
                del q, k, v
                torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("quick", "full", "ceiling", "small", "fp8", "moe", "x8", "zero"), default="quick")
    p.add_argument("--out", default=str(ROOT / "bench" / "results.jsonl"), help="JSONL file to append rows to")
    p.add_argument("--call-id", default=None, help="shared by the rows measured together (default: UTC time)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs available (default: nvidia-smi -L)")
    p.add_argument("--only", default=None, help="comma-separated config names of the suite")
    p.add_argument("--variants", default=None,
                   help="comma-separated mptrain variants run for every selected config (default: each config's own)")
    p.add_argument("--trainers", default=",".join(TRAINERS), help="mptrain,megatron-core (either or both)")
    p.add_argument("--budget-s", type=float, default=560.0, help="whole-script deadline in seconds")
    p.add_argument("--profile", nargs="?", const="base", default=None, metavar="VARIANTS",
                   help="profile these mptrain variants (comma-separated; default base): kernel tables in the logs")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations of every config (default: the suite's); longer windows shrink the "
                        "share of the start-up lead and the final drain of a trainer that runs ahead of the device")
    p.add_argument("--no-reference", action="store_true",
                   help="leave out the plain-PyTorch reference runs (an A/B of mptrain variants only)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--plan", action="store_true",
                   help="print the GPU jobs (rows, needs, estimated minutes, command of each), run nothing")
    p.add_argument("--call", type=int, default=None, metavar="K",
                   help="run only the K-th GPU job of the plan (1-based; see --plan)")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="every runnable row's first steps on CPU (gloo) with a stand-in tiny model, layout kept "
                        "(bench/x8.py); megatron-core and profiled runs are listed, not run")
    p.add_argument("--probe-sdpa", default=None, metavar="FILE", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if args.probe_sdpa:
        probe_sdpa(args.probe_sdpa)
        return 0
    t_start = time.time()
    offline = args.dry_run or args.plan or args.dry_run_cpu
    gpus = args.gpus if args.gpus is not None else (detect_gpus() or ((8 if args.suite == "x8" else 2) if offline else 0))
    if gpus < 1:
        print("run_bench: no GPU found (nvidia-smi -L); pass --gpus N, or --dry-run", file=sys.stderr)
        return 2
    trainers = tuple(t for t in args.trainers.split(",") if t)
    bad = set(trainers) - set(TRAINERS)
    if bad:
        print(f"run_bench: --trainers {sorted(bad)} unknown; use {','.join(TRAINERS)}", file=sys.stderr)
        return 2
    call_id = args.call_id or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    configs = suite(args.suite, gpus, args.only.split(",") if args.only else None)
    if args.iters is not None:
        configs = [dataclasses.replace(c, iters=args.iters) for c in configs]
    if args.variants:  # replaces every config's own list
        chosen = tuple(v for v in args.variants.split(",") if v)
        unknown = sorted(set(chosen) - set(VARIANTS))
        if unknown:
            print(f"run_bench: --variants {unknown} unknown; known: {','.join(sorted(VARIANTS))}", file=sys.stderr)
            return 2
        chosen = tuple(sorted(chosen, key=lambda v: v != "base"))  # base first: the loss reference of the others
        configs = [dataclasses.replace(c, variants=chosen) for c in configs]
    out = Path(args.out).resolve()
    log_dir = out.parent / "bench_logs" / call_id
    jobs = plan(configs, suite_name=args.suite, log_dir=log_dir, python=args.python, trainers=trainers,
                profile=tuple(args.profile.split(",")) if args.profile else (),
                probe=not args.only and args.call is None, reference=not args.no_reference)
    calls = split_calls(jobs)
    if args.plan:
        print_plan(jobs, calls, suite=args.suite, gpus=gpus)
        return 0
    if args.call is not None:
        if not 1 <= args.call <= len(calls):
            print(f"run_bench: --call {args.call}: the plan has calls 1..{len(calls)} (--plan lists them)", file=sys.stderr)
            return 2
        jobs = [jobs[i] for i in calls[args.call - 1]]
    if args.dry_run_cpu:  # the selected configs again, on the stand-in model (the calls are the real configs')
        names = {c.name for j in jobs for c in j.get("cfgs") or [j["cfg"]] if c is not None}
        jobs = plan([cpu_config(c) for c in configs if c.name in names], suite_name=args.suite, log_dir=log_dir,
                    python=args.python, trainers=trainers, probe=False, reference=False)
        log_dir.mkdir(parents=True, exist_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {"gpu_name": None, "time_utc": call_id}
        return 1 if run_cpu(jobs, rb=sys.modules[__name__], python=args.python, log_dir=log_dir, env=env,
                            call_id=call_id, out=out) else 0
    if args.dry_run:
        print(f"# suite={args.suite} gpus={gpus} call_id={call_id} out={out} ({len(jobs)} runs)")
        for job in jobs:
            print(f"# {job['trainer']} {job['cfg'].name if job['cfg'] else job['kind']} [{job['variant']}] timeout {job['timeout_s']}s")
            print(" ".join(job["argv"]))
        return 0
    log_dir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(args.python)
    print(f"=== run_bench suite={args.suite} gpus={gpus} call_id={call_id} env={json.dumps(env)}", flush=True)
    (log_dir / "env.json").write_text(json.dumps(env, indent=1))
    summary = []
    predict = args.suite in ("x8", "zero")  # the planner's columns beside each row (and its memory's skip)
    base_rows: dict = {}  # config name -> its mptrain "base" row of this call
    ours: dict = {}  # (config, variant) -> its mptrain row of this call
    for job in jobs:
        name = job["cfg"].name if job["cfg"] else job["kind"]
        left = args.budget_s - (time.time() - t_start) - 5
        rows: list = []
        prediction = (planner_prediction(job["cfg"], job["variant"]) if predict and job["kind"] == "mptrain"
                      and not job.get("needs") else {})
        unfit = does_not_fit(job["cfg"], prediction, env.get("gpu_mem_gib")) if job["kind"] in ("mptrain", "peer") else None
        if job.get("needs") or unfit:
            status, secs = ("needs: " + ", ".join(job["needs"])) if job.get("needs") else f"skipped: {unfit}", 0.0
            rows = failed_rows(job, env=env, call_id=call_id, status=status.split(":")[0], detail=status)
            print(f"--- {job['trainer']} {name} [{job['variant']}]: {status}", flush=True)
        elif left < 40:
            status, secs = f"skipped: {left:.0f}s of budget left", 0.0
            if job["kind"] not in ("probe", "profile"):
                rows = failed_rows(job, env=env, call_id=call_id, status="skipped", detail=status)
        else:
            print(f"--- [t={time.time() - t_start:5.0f}s] {job['trainer']} {name} [{job['variant']}] (timeout "
                  f"{min(job['timeout_s'], left):.0f}s): {' '.join(job['argv'])}", flush=True)
            rc, secs = run_process(job["argv"], job["log"], min(job["timeout_s"], left), job.get("env"))
            status = "ok" if rc == 0 else ("timeout" if rc is None else f"failed rc={rc}")
            if rc == 0:
                try:
                    rows = collect(job, env=env, call_id=call_id)
                except Exception as err:  # noqa: BLE001 -- a bad result is recorded, the suite goes on
                    status = f"failed: {err!r}"
            if status != "ok":
                print(_tail(job["log"]), flush=True)
                if job["kind"] not in ("probe", "profile"):
                    rows = failed_rows(job, env=env, call_id=call_id, status=status.split(":")[0],
                                       detail=_tail(job["log"], 8))
        env_prefix = "".join(f"{k}={v} " for k, v in (job.get("env") or {}).items())
        for row in rows:
            command = env_prefix + portable_command(job["argv"], python=args.python, out_dir=out.parent)
            row.update(command=command, wall_s=round(secs, 1), **prediction_of(row, job, prediction, predict))
            if row["trainer"] == "mptrain-moe-share" and row.get("status") == "ok":
                share_of_step(row, ours)
            if row["trainer"] == "mptrain" and row.get("status") == "ok":
                if row["variant"] == "base":
                    base_rows[row["config"]] = row
                compare_losses(row, base_rows.get(row["config"]))
                ours[(row["config"], row["variant"])] = row
                compare_baseline(row, job, ours)
        if job["kind"] == "profile" and status == "ok":
            print("\n".join(job["profile_file"].read_text().splitlines()[:14]), flush=True)
        with open(out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        for row in rows:
            summary.append(row)
            print(f"    {status} in {secs:.0f}s: {row['trainer']} {row['config']} [{row['variant']}] "
                  f"tok/s/GPU={row['tokens_per_s_per_gpu']} TFLOP/s/GPU={row['tflops_per_gpu']} MFU={row['mfu']} "
                  f"peak={row['peak_mem_gib']} GiB", flush=True)
        if not rows:
            print(f"    {status} in {secs:.0f}s", flush=True)
    print(f"=== SUMMARY call_id={call_id} gpu={env.get('gpu_name')} total {time.time() - t_start:.0f}s")
    print(f"{'trainer':14s} {'config':26s} {'variant':12s} {'tok/s/GPU':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peakGiB':>8s} "
          f"{'loss 1st/last':>15s} {'dloss':>8s} {'planGiB':>8s} {'plan s':>7s} {'vs base':>7s} status")
    for r in summary:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        losses = r.get("loss_first_last") or [None, None]
        loss = "/".join("-" if v is None else f"{v:.4f}" for v in losses)
        print(f"{r['trainer']:14s} {r['config']:26s} {r['variant']:12s} {str(r['tokens_per_s_per_gpu']):>10s} "
              f"{str(r['tflops_per_gpu']):>8s} {mfu:>6s} {str(r['peak_mem_gib']):>8s} {loss:>15s} "
              f"{str(r.get('loss_max_abs_diff_vs_base', '-')):>8s} {str(r.get('planned_mem_gib', '-')):>8s} "
              f"{str(r.get('planned_step_s', '-')):>7s} {str(r.get('vs_baseline', '-')):>7s} {r['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
