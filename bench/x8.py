"""The 8-GPU table's planning: which rows can run on this checkout, the GPU jobs, the planner's columns,
and the CPU dry run.

    python3 bench/run_bench.py --suite x8 --plan                      # rows, calls, estimated minutes, commands
    python3 bench/run_bench.py --suite x8 --call 2 --out $OUT/r.jsonl # the second call's rows on 8 GPUs
    python3 bench/run_bench.py --suite x8 --dry-run-cpu               # every runnable row's first steps on CPU

* ``needs``: a row whose Hydra overrides name a key that the config schema (`mptrain.config.schema.Config`)
  does not have is not run; its row says ``needs: <key>`` and it runs once the key exists.
* Calls (`split_calls`): a config's mptrain and megatron-core jobs (a sweep's jobs) stay in one call, a baseline
  (`BenchConfig.baseline`: the row's ``vs_baseline`` divisor) with its rows where they fit, else re-run first in
  each call that needs it; blocks go first-fit, in suite order, into calls of at most `CALL_BUDGET_S` estimated
  seconds (a device command is capped at 600 s). Estimates (`estimate_s`) are assumptions to be replaced by the
  first call's wall times: start-up, compile, and iterations at `ASSUMED_MFU` of the dense bf16 peak through
  the pipeline bubble.
* The planner's columns: `mptrain.planner` on the row's own config (``planned_mem_gib``: the busiest stage's
  total; ``planned_step_s``: its assumed-hardware step time), and the skip of a row whose planned memory
  exceeds the GPU's (rows with `BenchConfig.fit_check`, the sharding the planner models).
* CPU dry run: every runnable row with its model replaced by an 8-layer, 8-head stand-in (``tiny_x8``,
  ``moe_tiny_x8`` with 8 experts; the layout kept), micro batch 1, 1 warm-up + 1 timed iteration, gloo. Rows
  of one world size run one after another in one launch (`bench/x8_rows.py`: the sweeps' reuse of the default
  process group), smallest world first (the baselines), a sweep as its own ``-m`` launch of
  `bench/mptrain_entry.py`, so 2 cores start Python once per rank and world size, not per row. megatron-core and
  the profiled runs are GPU-only and listed as such.
"""

from __future__ import annotations

import dataclasses
import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Optional

from configs import PEAK_TFLOPS_BF16_DENSE, VARIANTS, BenchConfig, flops_per_iteration, mptrain_overrides

HERE = Path(__file__).resolve().parent
CALL_BUDGET_S = 520.0  # of a 600 s device command: the wheels' install and the environment probe come first
LAUNCH_S = 30.0  # torchrun, imports, NCCL set-up, model build (ASSUMED)
COMPILE_S = 25.0  # the first compiled step of a job (ASSUMED; Inductor's cache makes later layouts cheaper)
ASSUMED_MFU = 0.40
ITER_MARGIN = 1.3  # iteration time over the MFU estimate (warm-up iterations, host lead)
PEER_SLOWDOWN = 2.0  # megatron-core's local spec against mptrain (1.2-2.4× in the earlier reports)


# ------------------------------------------------------------------------------------- needs
@lru_cache(maxsize=1)
def schema_keys() -> frozenset:
    """Every dotted key of the training config's schema (``model.num_layers``, ``parallel....``)."""
    from mptrain.config.schema import Config
    from mptrain.config.suggest import known_keys

    return frozenset(known_keys(Config()))


def needs(overrides: list) -> list:
    """The keys of ``key=value`` overrides (group choices such as ``parallel=tp2pp4`` aside) that the schema
    lacks, in order: a row naming one waits for the feature that adds it."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o and "." in o.split("=", 1)[0]]
    return [k for k in dict.fromkeys(keys) if not k.startswith("hydra.") and k not in schema_keys()]


def job_needs(job: dict) -> list:
    """`needs` of an mptrain job's (or a sweep's) overrides; [] for the other kinds."""
    if job["kind"] not in ("mptrain", "profile", "sweep"):
        return []
    return needs([a for a in job["argv"] if "=" in a and not a.startswith("--")])


# ------------------------------------------------------------------------------------- estimates
def _bubble(cfg: BenchConfig) -> float:
    if cfg.pp == 1:
        return 0.0
    return (cfg.pp - 1) / ((cfg.vpp or 1) * cfg.num_microbatches + cfg.pp - 1)


def step_estimate_s(cfg: BenchConfig) -> float:
    """Seconds of one iteration at `ASSUMED_MFU` (recomputed forward work included) through the bubble."""
    flops = flops_per_iteration(cfg) * (4 / 3 if cfg.recompute == "full" else 1.0)
    return flops / (cfg.gpus * PEAK_TFLOPS_BF16_DENSE * 1e12 * ASSUMED_MFU) / (1.0 - _bubble(cfg))


def estimate_s(job: dict) -> float:
    """Estimated wall seconds of one job (module docstring); 0 for a job that will not run (``needs``)."""
    if job.get("needs"):
        return 0.0
    if job["cfg"] is None:  # the SDPA probe, the plain-PyTorch ceiling: their timeout
        return float(job["timeout_s"])
    cfgs = job.get("cfgs") or [job["cfg"]]
    iters = sum((c.warmup + c.iters) * step_estimate_s(c) for c in cfgs)
    if job["kind"] == "peer":
        return LAUNCH_S + iters * PEER_SLOWDOWN
    compiled = "model.compile_layers=false" not in VARIANTS.get(job["variant"], ())
    return LAUNCH_S + len(cfgs) * (COMPILE_S if compiled else 0.0) + iters * ITER_MARGIN


def units(jobs: list) -> list:
    """Jobs grouped into what one call must hold together: a config's (or a sweep's configs') jobs."""
    out: list = []
    key_of = {}
    for i, job in enumerate(jobs):
        cfgs = job.get("cfgs") or ([job["cfg"]] if job["cfg"] is not None else [])
        key = next((key_of[c.name] for c in cfgs if c.name in key_of), None)
        if key is None:
            key = len(out)
            out.append([])
        for c in cfgs:
            key_of[c.name] = key
        out[key].append(i)
    return out


def _cfgs(job: dict) -> list:
    return [c for c in job.get("cfgs") or [job["cfg"]] if c is not None]


def blocks(jobs: list, budget_s: float = CALL_BUDGET_S) -> list:
    """`units` with each unit whose config names a `BenchConfig.baseline` joined to the block before it when that
    block holds the baseline and the two fit one call together (a baseline and its rows measured on one machine)."""
    out: list = []
    for unit in units(jobs):
        baselines = {c.baseline for i in unit for c in _cfgs(jobs[i]) if c.baseline}
        last = {c.name for i in out[-1] for c in _cfgs(jobs[i])} if out else set()
        if baselines and baselines <= last and sum(estimate_s(jobs[i]) for i in out[-1] + unit) <= budget_s:
            out[-1] += unit
        else:
            out.append(list(unit))
    return out


def split_calls(jobs: list, budget_s: float = CALL_BUDGET_S) -> list:
    """Lists of job indices, one per GPU job: each of the `blocks`, in suite order, goes to the first call
    it fits (estimated seconds within ``budget_s``), else opens a call (a block alone longer than that gets its
    own). A block whose config names a baseline that the call lacks brings the baseline's mptrain run into that
    call, first (ratios are taken within one call, on one machine), so a baseline may run in several calls."""
    first_run = {}
    for i, job in enumerate(jobs):
        if job["kind"] in ("mptrain", "sweep"):
            for c in _cfgs(job):
                first_run.setdefault(c.name, i)
    calls: list = []
    for block in blocks(jobs, budget_s):
        wanted = dict.fromkeys(c.baseline for i in block for c in _cfgs(jobs[i]) if c.baseline in first_run)
        extra = [first_run[b] for b in wanted if first_run[b] not in block]

        def cost(call: list) -> float:
            return sum(estimate_s(jobs[i]) for i in call + block + [i for i in extra if i not in call])

        call = next((c for c in calls if cost(c) <= budget_s), None)
        if call is None:
            call = []
            calls.append(call)
        call[:0] = [i for i in extra if i not in call]  # the baseline first: its row divides the rows after it
        call += block
    return calls


def call_configs(jobs: list, call: list) -> list:
    """The config names of one call, in order (its ``--only``)."""
    names = []
    for i in call:
        for c in jobs[i].get("cfgs") or [jobs[i]["cfg"]]:
            if c is not None and c.name not in names:
                names.append(c.name)
    return names


def print_plan(jobs: list, calls: list, *, suite: str, gpus: int) -> None:
    """Each call: its rows (with ``needs: <key>`` where the schema lacks one), estimated minutes, command."""
    total = sum(estimate_s(j) for j in jobs)
    print(f"# suite={suite} gpus={gpus}: {len(calls)} GPU jobs, estimated {total / 60:.1f} min of runs "
          f"(budget {CALL_BUDGET_S:.0f} s a call; estimates assume MFU {ASSUMED_MFU}, {LAUNCH_S:.0f} s a launch, "
          f"{COMPILE_S:.0f} s a compile)")
    for k, call in enumerate(calls, 1):
        secs = sum(estimate_s(jobs[i]) for i in call)
        print(f"## call {k}/{len(calls)}: ~{secs / 60:.1f} min")
        for i in call:
            job = jobs[i]
            name = ",".join(c.name for c in job.get("cfgs") or [job["cfg"]])
            status = f"needs: {', '.join(job['needs'])}" if job.get("needs") else f"~{estimate_s(job):.0f} s"
            print(f"   {job['trainer']:14s} {name} [{job['variant']}] {status}")
        print(f"   python3 bench/run_bench.py --suite {suite} --call {k} --out $OUT/results.jsonl")


# ------------------------------------------------------------------------------------- planner
def planner_prediction(cfg: BenchConfig, variant: str) -> dict:
    """The planner's memory (GiB, busiest stage) and assumed-hardware step time (s) for `cfg`'s own config:
    {"planned_mem_gib", "planned_step_s"}, or {"planned_error": line} when the planner refuses it."""
    from mptrain.config.schema import as_config
    from mptrain.data.tokenizers import build_tokenizer, check_vocab_size
    from mptrain.planner.config import compose_plan
    from mptrain.planner.layouts import config_layout, plan_layout
    from mptrain.training.validate import validate_config

    overrides = [o for o in mptrain_overrides(cfg, variant, "unused") if not o.startswith("run.")]
    try:
        c = as_config(compose_plan(overrides + [f"world_size={cfg.gpus}"]))
        d = validate_config(c, cfg.gpus)
        layout = config_layout(c, d)  # the row's strategy, HSDP shard size and offload included
        vocab = check_vocab_size(c.model.vocab_size, build_tokenizer(c.data).vocab_size)
        rec = plan_layout(c, layout, c.hardware, vocab_size=vocab)
    except Exception as err:  # noqa: BLE001 -- a refusal is the column's value, the row still runs
        return {"planned_error": str(err).splitlines()[0][:200] if str(err) else type(err).__name__}
    return {"planned_mem_gib": float(f"{rec['memory_gib']['total']:.4g}"), "planned_step_s": float(f"{rec['step_time_s']:.4g}")}


def does_not_fit(cfg: BenchConfig, prediction: dict, gpu_mem_gib: Optional[float]) -> Optional[str]:
    """Why `cfg` is skipped on a GPU of ``gpu_mem_gib`` (its planned memory is larger), or None."""
    planned = prediction.get("planned_mem_gib")
    if not cfg.fit_check or planned is None or not gpu_mem_gib or planned <= gpu_mem_gib:
        return None
    return f"planner: {planned:.1f} GiB per GPU > {gpu_mem_gib:.1f} GiB"


# ------------------------------------------------------------------------------------- CPU dry run
def cpu_config(cfg: BenchConfig) -> BenchConfig:
    """`cfg` with the CPU stand-in model (layout, precision, sharding, recomputation kept), micro batch 1,
    micro-batches cut to max(pp, 2) (8 in a sweep, whose layouts share one batch), 1 warm-up + 1 timed
    iteration (the design row: 2 + 2, so that its skipped steps and loss show)."""
    moe = cfg.preset.startswith("moe")
    iters = (2, 2) if cfg.iters >= 40 else (1, 1)
    extra = ("model.num_moe_experts=8",) if moe else ()
    m = min(cfg.num_microbatches, 8 if cfg.sweep else max(cfg.pp, 2))
    return dataclasses.replace(cfg, model="moe_tiny_x8" if moe else "tiny_x8", micro_batch_size=1, num_microbatches=m,
                               warmup=iters[0], iters=iters[1], overrides=cfg.overrides + extra, timeout_s=300)


def cpu_rows_job(jobs: list, world: int, *, python: str, log_dir: Path, torchrun) -> dict:
    """One launch of `bench/x8_rows.py` at ``world`` running the given mptrain jobs one after another
    (``torchrun``: `run_bench.torchrun`)."""
    spec = log_dir / f"rows_world{world}.json"
    spec.write_text(json.dumps([{"name": j["cfg"].name, "run_dir": str(j["run_dir"]),
                                 "overrides": [a for a in j["argv"][j["argv"].index(str(HERE / "mptrain_entry.py")) + 1:]]}
                                for j in jobs]))
    return dict(kind="rows", world=world, jobs=jobs, log=log_dir / f"cpu_world{world}.log",
                timeout_s=120 + 90 * len(jobs), argv=torchrun(python, world, HERE / "x8_rows.py", [str(spec)]))


def run_cpu(jobs: list, *, rb, python: str, log_dir: Path, env: dict, call_id: str, out: Path) -> int:
    """The CPU dry run of ``jobs`` (already on the stand-in configs): needs-rows listed, GPU-only jobs listed,
    the rest run (module docstring); rows appended to ``out``. ``rb``: the `run_bench` module (its launch and
    collection). Returns the number of failed jobs."""
    t0 = time.time()
    runnable = [j for j in jobs if j["kind"] in ("mptrain", "sweep") and not j.get("needs")]
    for job in jobs:
        name = ",".join(c.name for c in job.get("cfgs") or [job["cfg"]] if c is not None)
        if job.get("needs"):
            print(f"# {name} [{job['variant']}]: needs: {', '.join(job['needs'])} (skipped)")
        elif job not in runnable:
            print(f"# {name} [{job['trainer']}]: GPU only (not run on CPU)")
    launches = [cpu_rows_job([j for j in runnable if j["kind"] == "mptrain" and j["cfg"].gpus == w], w,
                             python=python, log_dir=log_dir, torchrun=rb.torchrun)
                for w in sorted({j["cfg"].gpus for j in runnable if j["kind"] == "mptrain"})]
    launches += [j for j in runnable if j["kind"] == "sweep"]
    failures = 0
    ours: dict = {}  # (config, variant) -> row: the baselines (one-GPU rows first: launches by world size)
    with open(out, "a") as f:
        for launch in launches:
            what = f"world {launch['world']}: {len(launch['jobs'])} rows" if launch["kind"] == "rows" else "sweep"
            print(f"--- [t={time.time() - t0:4.0f}s] {what}: {' '.join(launch['argv'])}", flush=True)
            rc, secs = rb.run_process(launch["argv"], launch["log"], launch["timeout_s"], {"OMP_NUM_THREADS": "1"})
            for job in launch.get("jobs") or [launch]:
                try:
                    rows = rb.collect(job, env=env, call_id=call_id)
                except Exception as err:  # noqa: BLE001 -- reported per row, the dry run goes on
                    failures += 1
                    rows = rb.failed_rows(job, env=env, call_id=call_id, status="failed", detail=f"{err!r} (rc={rc})")
                    print(f"    FAILED {job['cfg'].name}: {err!r}; log {launch['log']}", flush=True)
                for row in rows:
                    if row["status"] == "ok":
                        ours[(row["config"], row["variant"])] = row
                        rb.compare_baseline(row, job, ours)
                    row.update(planner_prediction(job["cfg"] if row["config"] == job["cfg"].name else
                                                  next(c for c in job["cfgs"] if c.name == row["config"]), job["variant"]))
                    f.write(json.dumps(row) + "\n")
                    print(f"    {row['status']}: {row['config']} {row['layout']} loss {row.get('loss_first_last')} "
                          f"skipped {row.get('skipped_iters')} vs baseline {row.get('vs_baseline', '-')} planned {row.get('planned_mem_gib')} GiB "
                          f"{row.get('planned_step_s')} s {row.get('planned_error', '')}", flush=True)
            print(f"    ({secs:.0f} s)", flush=True)
    print(f"=== CPU dry run: {len(runnable)} jobs in {len(launches)} launches, {failures} failed, "
          f"{time.time() - t0:.0f} s; rows in {out}")
    return failures
