"""Layout sweeps under torchrun (DESIGN.md §2): job folders, summary.md / summary.json, the failure policy.

    torchrun --nproc_per_node=8 train.py -m model=gpt_1.3b parallel=tp1pp8,tp2pp4,tp4pp2,tp8pp1 run.dir=S

Every rank runs Hydra's basic sweeper, so every rank runs the same jobs in the same order in one
process (the default process group is reused; each job builds and destroys its own groups).

- Sweep root: `run.dir` (null: a fresh `outputs/multirun`, `outputs/multirun-2`, ...,
  `mptrain.config.schema.fresh_sweep_root`); Hydra's `hydra.sweep.dir` points there too
  (`mptrain_sweep_root` resolver), so the only file Hydra writes, `multirun.yaml`, lands in it.
- Job folder: `<root>/<swept keys>`, e.g. `parallel=tp2pp1` or `parallel=tp2pp1,precision=bf16`:
  only the keys swept on the command line (or in `hydra.sweeper.params`), sorted, `key=value`
  joined by commas (Hydra's override_dirname format); `/` in a value becomes `_`.
- After every job, rank 0 rewrites `<root>/summary.json` and `<root>/summary.md` (per job: swept
  keys, all overrides, layout, tokens/s/GPU, MFU, peak memory, the last train loss, the final and
  the best validation loss and perplexity (an LR sweep is judged on those), status, message).
- A sweep run into a root that already holds one appends: its jobs are numbered after the ones
  summary.json already lists (`job_offset`, fixed when the sweep starts), so no job number appears
  twice and earlier jobs' rows stay (a job folder run again gets a second row with the new number).
- Policy: a job rejected by validation (`ConfigError`) is recorded as `rejected` and the sweep goes
  on; the process exits 1 when the sweep ends. Any other failure is recorded as `failed` and ends
  the sweep at once (exit 1; torchrun then stops the other ranks).

`SweepCallback` (a Hydra callback configured in conf/config.yaml) applies the policy, so the task
function only returns a `JobResult` (or raises): Hydra's launcher catches a job's `Exception`; the
callback's `on_job_end` sees it, records it, and either turns it into a recorded rejection
(so the basic sweeper carries on) or raises `SystemExit(1)` (which Hydra does not catch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from mptrain.errors import ConfigError

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
STATUSES = ("completed", "rejected", "failed")

# Hydra command-line flags that take a value (the value token is not an override).
_FLAGS_WITH_VALUE = {
    "-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name",
    "-cd", "--config-dir", "--experimental-rerun", "-sc", "--shell-completion",
}
_INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def command_line_overrides(argv: Sequence[str]) -> list[str]:
    """The override tokens of a Hydra command line (flags and their values dropped).

    Args:
        argv: the arguments after the script name (`sys.argv[1:]`).
    """
    out, skip = [], False
    for i, tok in enumerate(argv):
        if skip:
            skip = False
            continue
        if tok.startswith("-"):
            flag = tok.split("=", 1)[0]
            if "=" not in tok and flag in _FLAGS_WITH_VALUE:
                skip = True
            elif flag in ("-i", "--info") and "=" not in tok and i + 1 < len(argv) and argv[i + 1] in _INFO_TOPICS:
                skip = True
            continue
        out.append(tok)
    return out


def swept_keys(overrides: Sequence[str], sweeper_params: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Keys whose override is a sweep (`a=1,2`, `range(..)`, `choice(..)`, `glob(..)`), sorted.

    Parsed with Hydra's own override grammar, so quoting and nested lists behave as on the command
    line. Keys of `hydra.sweeper.params` count as swept too.

    Raises:
        ConfigError: `run.dir` is swept (it names the sweep root, not a job).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    keys = {o.key_or_group for o in parser.parse_overrides(list(overrides)) if o.is_sweep_override()}
    keys |= set((sweeper_params or {}).keys())
    keys = {k.lstrip("+~") for k in keys}
    if "run.dir" in keys:
        raise ConfigError("run.dir cannot be swept: it is the sweep root; sweep other keys and pass one run.dir=")
    return sorted(k for k in keys if not k.startswith("hydra"))


def job_subdir(job_overrides: Sequence[str], keys: Sequence[str]) -> str:
    """The job folder name: this job's `key=value` for the swept keys, sorted by key, joined by commas.

    Example: overrides ["model=tiny", "parallel=tp2pp1", "train.train_iters=3"], keys ["parallel"]
    → "parallel=tp2pp1".
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(job_overrides))
    wanted = set(keys)
    items = sorted(
        (o.key_or_group.lstrip("+~"), o.get_value_element_as_str()) for o in parsed if o.key_or_group.lstrip("+~") in wanted
    )
    name = ",".join(f"{k}={v}" for k, v in items) or "job"
    return name.replace(os.sep, "_")


@dataclasses.dataclass(frozen=True)
class SweepJob:
    """One job of a multirun, as every rank sees it.

    Attributes:
        root: the sweep root folder.
        subdir: the job folder name under it (`job_subdir`).
        num: Hydra's job number (0-based, command-line order).
        overrides: all of this job's overrides.
        swept: the swept keys.
    """

    root: str
    subdir: str
    num: int
    overrides: tuple
    swept: tuple

    @property
    def dir(self) -> Path:
        return Path(self.root) / self.subdir


def sweep_job_from_hydra_config(hydra_cfg: Any, argv: Sequence[str]) -> Optional[SweepJob]:
    """The `SweepJob` of a job's Hydra config node (`HydraConfig.get()` or `config.hydra`); None for a single run.

    Args:
        hydra_cfg: the `hydra` node of the job's config.
        argv: the command line after the script name (the sweep syntax lives only there).
    """
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    if _launched_elsewhere(hydra_cfg):
        argv = _multirun_command_line(hydra_cfg.sweep.dir)
    params = dict(hydra_cfg.sweeper.get("params") or {}) if "sweeper" in hydra_cfg else {}
    keys = swept_keys(command_line_overrides(argv), params)
    overrides = list(hydra_cfg.overrides.task)
    return SweepJob(
        root=str(hydra_cfg.sweep.dir),
        subdir=job_subdir(overrides, keys),
        num=int(hydra_cfg.job.num),
        overrides=tuple(overrides),
        swept=tuple(keys),
    )


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def _launched_elsewhere(hydra_cfg: Any) -> bool:
    """Whether this job runs under a launcher other than Hydra's basic one (e.g. submitit on SLURM).

    Such a job runs in a process whose `sys.argv` is the launcher's (`python -m
    submitit.core._submit FOLDER`), not the sweep's command line.
    """
    launcher = hydra_cfg.get("launcher") if hasattr(hydra_cfg, "get") else None
    target = launcher.get("_target_", BASIC_LAUNCHER) if launcher is not None else BASIC_LAUNCHER
    return target != BASIC_LAUNCHER


def _multirun_command_line(root: str) -> list[str]:
    """The sweep's command-line overrides as Hydra's sweeper saved them (`<root>/multirun.yaml`, `hydra.overrides.task`).

    The sweeper writes that file before it launches any job, on the submitting host, into the
    sweep root (a shared filesystem under SLURM).
    """
    from omegaconf import OmegaConf

    saved = OmegaConf.load(Path(root) / "multirun.yaml")
    return list(saved.hydra.overrides.task)


def current_sweep_job(argv: Optional[Sequence[str]] = None) -> Optional[SweepJob]:
    """This process's current `SweepJob` from Hydra's global `HydraConfig` (None: single run, or no Hydra).

    Args:
        argv: the command line after the script name; None reads `sys.argv[1:]` (call from the entry point).
    """
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return sweep_job_from_hydra_config(HydraConfig.get(), sys.argv[1:] if argv is None else argv)


@dataclasses.dataclass
class JobResult:
    """What a finished job reports for the sweep summary (rank 0's view; None where unknown).

    Attributes:
        layout: e.g. `dataclasses.asdict(DerivedLayout)` (tp, pp, dp, vpp, num_microbatches, schedule).
        tokens_per_s_per_gpu: tokens / s / process, averaged over the timed iterations.
        mfu: model FLOP utilisation (0-1), None on CPU.
        peak_memory_gib: peak allocated accelerator memory (GiB), None on CPU.
        final_loss: lm_loss of the last training iteration.
        run_dir: the job's run folder.
        final_valid_loss, final_valid_ppl: the last `valid` row of metrics.jsonl (nats per token, exp).
        best_valid_loss, best_valid_ppl, best_valid_iteration: its lowest `valid` lm_loss, and where.
    """

    layout: Optional[dict] = None
    tokens_per_s_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    final_loss: Optional[float] = None
    run_dir: Optional[str] = None
    final_valid_loss: Optional[float] = None
    final_valid_ppl: Optional[float] = None
    best_valid_loss: Optional[float] = None
    best_valid_ppl: Optional[float] = None
    best_valid_iteration: Optional[int] = None


def eval_summary(rows: Sequence[Mapping[str, Any]]) -> dict:
    """The final and the best validation numbers of a job's metrics.jsonl rows (JobResult fields).

    Rows whose lm_loss is null (a non-finite loss) do not count for the best. All None without
    `valid` rows (evaluation off).
    """
    valid = [r for r in rows if r.get("split") == "valid"]
    out = dict.fromkeys(("final_valid_loss", "final_valid_ppl", "best_valid_loss", "best_valid_ppl",
                         "best_valid_iteration"))
    if not valid:
        return out
    out["final_valid_loss"], out["final_valid_ppl"] = valid[-1]["lm_loss"], valid[-1]["ppl"]
    finite = [r for r in valid if r["lm_loss"] is not None]
    if finite:
        best = min(finite, key=lambda r: r["lm_loss"])
        out.update(best_valid_loss=best["lm_loss"], best_valid_ppl=best["ppl"], best_valid_iteration=best["iteration"])
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_summary(root: str | os.PathLike) -> dict:
    """The summary.json of a sweep root ({"jobs": []} when there is none yet)."""
    path = Path(root) / SUMMARY_JSON
    if not path.exists():
        return {"jobs": []}
    return json.loads(path.read_text())


def start_sweep(root: str | os.PathLike) -> int:
    """Fix this sweep's job numbering in `<root>/summary.json`; returns its `job_offset`. Rank 0, once per sweep.

    A root without a summary starts at 0; a root holding an earlier sweep continues after its
    highest job number (the jobs of this sweep are numbered offset + Hydra's job number).
    """
    root = Path(root)
    summary = read_summary(root)
    offset = max((j["job"] for j in summary["jobs"]), default=-1) + 1
    if summary["jobs"]:
        root.mkdir(parents=True, exist_ok=True)
        summary["job_offset"] = offset
        _atomic_write(root / SUMMARY_JSON, json.dumps(summary, indent=2) + "\n")
    return offset


def record_job(job: SweepJob, *, status: str, result: Optional[JobResult] = None, message: Optional[str] = None) -> dict:
    """Add (or replace, by job number) one job's entry and rewrite summary.json and summary.md. Rank 0 only.

    The entry's number is the summary's `job_offset` (`start_sweep`; 0 when absent) + `job.num`.

    Args:
        job: the job.
        status: completed | rejected | failed.
        result: the job's numbers (completed jobs).
        message: the one-line error (rejected / failed jobs).
    Returns:
        the whole summary dict as written.
    """
    if status not in STATUSES:
        raise ValueError(f"record_job: status {status!r} not in {STATUSES}")
    root = Path(job.root)
    root.mkdir(parents=True, exist_ok=True)
    summary = read_summary(root)
    offset = int(summary.get("job_offset", 0))
    entry = {
        "job": offset + job.num,
        "dir": job.subdir,
        "swept": {k: v for k, v in (o.split("=", 1) for o in job.overrides if "=" in o) if k.lstrip("+~") in job.swept},
        "overrides": list(job.overrides),
        "status": status,
        "message": message,
        **dataclasses.asdict(result or JobResult()),
    }
    jobs = [j for j in summary["jobs"] if j["job"] != entry["job"]] + [entry]
    jobs.sort(key=lambda j: j["job"])
    summary = {"jobs": jobs, "job_offset": offset, **{s: sum(j["status"] == s for j in jobs) for s in STATUSES}}
    _atomic_write(root / SUMMARY_JSON, json.dumps(summary, indent=2) + "\n")
    _atomic_write(root / SUMMARY_MD, summary_markdown(summary))
    return summary


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _layout_text(layout: Optional[dict]) -> str:
    if not layout:
        return "-"
    vpp = layout.get("virtual_pipeline_model_parallel_size")
    parts = [
        f"tp{layout.get('tensor_model_parallel_size')}",
        f"pp{layout.get('pipeline_model_parallel_size')}",
        f"dp{layout.get('data_parallel_size')}",
    ]
    if vpp:
        parts.append(f"vpp{vpp}")
    return " ".join(parts) + f", {layout.get('num_microbatches')} mb, {layout.get('schedule')}"


def _loss_ppl(loss: Optional[float], ppl: Optional[float], iteration: Optional[int] = None) -> str:
    if loss is None:
        return "-"
    return f"{loss:.4f} ({_num(ppl, '.2f')})" + (f" @ {iteration}" if iteration is not None else "")


def summary_markdown(summary: dict) -> str:
    """summary.md: one table row per job, then the status counts."""
    lines = [
        "# Sweep summary",
        "",
        "| job | swept | layout | tokens/s/GPU | MFU | peak mem (GiB) | last train loss | final valid loss (ppl) "
        "| best valid loss (ppl) @ iter | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j in summary["jobs"]:
        status = j["status"] + (f": {j['message']}" if j.get("message") else "")
        status = status.replace("|", "\\|")
        lines.append(
            f"| {j['job']} | `{j['dir']}` | {_layout_text(j.get('layout'))} | {_num(j.get('tokens_per_s_per_gpu'), '.1f')} | "
            f"{_num(j.get('mfu'), '.3f')} | {_num(j.get('peak_memory_gib'), '.2f')} | {_num(j.get('final_loss'), '.4f')} | "
            f"{_loss_ppl(j.get('final_valid_loss'), j.get('final_valid_ppl'))} | "
            f"{_loss_ppl(j.get('best_valid_loss'), j.get('best_valid_ppl'), j.get('best_valid_iteration'))} | {status} |"
        )
    counts = ", ".join(f"{summary.get(s, 0)} {s}" for s in STATUSES)
    lines += ["", f"{len(summary['jobs'])} jobs: {counts}.", ""]
    return "\n".join(lines)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # No process group (yet / any more): torchrun's RANK is the launcher's contract, not an internal switch.
    # Under SLURM without torchrun (Hydra's submitit launcher), the task's rank is SLURM_PROCID.
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


try:  # Hydra is a hard dependency of the project; the guard only keeps imports cheap in odd environments.
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object


class SweepCallback(_HydraCallback):
    """Hydra callback applying the sweep policy (configured under `hydra.callbacks` in conf/config.yaml).

    State (the per-process count of rejected jobs) lives on this object, which Hydra creates once
    per process and keeps for the whole multirun. Inactive in single runs (train.py handles those).

    Args:
        argv: the command line after the script name; None = `sys.argv[1:]`.
        rank: this process's global rank; None = torch.distributed's rank (0 before init).
        stream: where the one-line messages go (stderr by default).
    """

    def __init__(self, argv: Optional[Sequence[str]] = None, rank: Optional[int] = None, stream: Any = None) -> None:
        self.argv = argv
        self.rank = rank
        self.stream = stream
        self.rejected = 0
        self.jobs = 0
        self.root: Optional[str] = None

    def _say(self, text: str) -> None:
        if self._get_rank() == 0:
            print(text, file=self.stream or sys.stderr, flush=True)

    def _get_rank(self) -> int:
        return _rank() if self.rank is None else self.rank

    def _number(self, job: SweepJob) -> int:
        """The job's number in summary.json (offset + Hydra's number); read on rank 0 only, which says it."""
        return job.num + (int(read_summary(job.root).get("job_offset", 0)) if self._get_rank() == 0 else 0)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Rank 0 fixes the job numbering before any job runs (`start_sweep`: a root that holds an
        earlier sweep gets new numbers after its jobs)."""
        if self._get_rank() == 0:
            start_sweep(config.hydra.sweep.dir)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        job = sweep_job_from_hydra_config(config.hydra, sys.argv[1:] if self.argv is None else self.argv)
        if job is None:
            return
        self.jobs += 1
        self.root = job.root
        is_rank0 = self._get_rank() == 0
        if job_return.status == JobStatus.COMPLETED:
            value = job_return.return_value
            if isinstance(value, dict):
                value = JobResult(**{f.name: value.get(f.name) for f in dataclasses.fields(JobResult)})
            result = value if isinstance(value, JobResult) else None
            if is_rank0:
                record_job(job, status="completed", result=result)
            return
        error = job_return._return_value  # the exception (the public property re-raises it)
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, ConfigError):
            self.rejected += 1
            if is_rank0:
                record_job(job, status="rejected", message=message)
            self._say(f"sweep job {self._number(job)} ({job.subdir}) rejected: {message}")
            # Let the basic sweeper carry on: it raises on the first FAILED job after the batch.
            job_return.status = JobStatus.COMPLETED
            job_return.return_value = None
            return
        if is_rank0:
            record_job(job, status="failed", message=f"{type(error).__name__}: {message}")
        traceback.print_exception(type(error), error, error.__traceback__, file=self.stream or sys.stderr)
        self._say(f"sweep job {self._number(job)} ({job.subdir}) failed, aborting the sweep: {type(error).__name__}: {message}")
        raise SystemExit(1)  # BaseException: Hydra's callback wrapper and launcher let it through

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Every rank ran the same jobs; wait for rank 0's last summary write before any rank
            # exits (torchrun stops the others as soon as one exits non-zero).
            dist.barrier()
        if self.rejected:
            where = f"; see {Path(self.root or '.') / SUMMARY_MD}"
            self._say(f"sweep: {self.rejected} of {self.jobs} jobs rejected by validation{where}")
            raise SystemExit(1)
