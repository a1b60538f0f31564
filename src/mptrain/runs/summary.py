"""A sweep root's summary.json and summary.md (what they hold: DESIGN.md §2), rewritten by rank 0 after every job.

A second sweep into the same root appends: `start_sweep` numbers its jobs after the ones summary.json
already lists, so no job number appears twice and earlier rows stay.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
STATUSES = ("completed", "rejected", "failed")


@dataclasses.dataclass(frozen=True)
class SweepJob:
    """One job of a sweep, as every rank sees it (`mptrain.runs.sweep.current_sweep_job`).

    Attributes:
        root: the sweep root folder.
        subdir: the job folder name under it: the swept keys' `key=value`, sorted, joined by commas.
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
