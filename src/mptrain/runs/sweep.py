"""Sweeps (`-m`, or `hydra.mode=MULTIRUN`): the sweep root, each job's folder, the failure policy (DESIGN.md §2).

    torchrun --nproc_per_node=8 train.py -m model=gpt_1.3b parallel=tp1pp8,tp2pp4,tp4pp2,tp8pp1

Every rank runs Hydra's basic sweeper, so every rank runs the same jobs in the same order in one
process (the default process group is reused; each job builds and destroys its own groups).

`SweepCallback` (a Hydra callback configured in conf/config.yaml) owns the sweep:
- `on_multirun_start`, once per sweep and before any job is composed, reads the sweep's own overrides
  from Hydra's config (`hydra.overrides.task`, `hydra.sweeper.params`), decides the root
  (`sweep_root`) and which keys are swept (`plan_sweep`), and hands both to every job through hydra
  overrides (`SweepPlan.hydra_overrides`: `hydra.sweep.dir`, and the unswept keys as
  `hydra.job.config.override_dirname.exclude_keys`), which Hydra applies to each job's config under
  any launcher (`ConfigLoader.load_sweep_config`, also in a submitit process). A job then reads its
  folder from `HydraConfig` (`current_sweep_job`): `<hydra.sweep.dir>/<hydra.job.override_dirname>`.
- `on_job_end` records each job in the summary (`mptrain.runs.summary`) and applies the policy:
  Hydra's launcher catches a job's `Exception`; a `ConfigError` becomes a recorded rejection (the
  basic sweeper carries on), anything else raises `SystemExit(1)` (which Hydra does not catch).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from omegaconf import OmegaConf, read_write

from mptrain.errors import ConfigError, launch_rank_and_world, report_and_exit
from mptrain.runs.folder import holds_run, run_dir_from_command_line
from mptrain.runs.summary import SUMMARY_JSON, SUMMARY_MD, JobResult, SweepJob, read_summary, record_job, start_sweep

DEFAULT_SWEEP_ROOT = "outputs/multirun"
"""The root of a sweep whose config names no `run.dir`."""
HYDRA_FILES = {"multirun.yaml"}
"""What Hydra's sweeper writes into the root on every rank as the sweep starts (a root holding only it is free)."""


def swept_keys(overrides: Sequence[str], sweeper_params: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Keys whose override is a sweep (`a=1,2`, `range(..)`, `choice(..)`, `glob(..)`), sorted.

    Parsed with Hydra's own override grammar, so quoting and nested lists behave as on the command
    line. Keys of `hydra.sweeper.params` count as swept too.

    Raises:
        ConfigError: `run.dir` is swept (it names the sweep root, not a job).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    keys = {o.key_or_group for o in parsed if o.is_sweep_override()} | set(sweeper_params or {})
    keys = {k.lstrip("+~") for k in keys}
    if "run.dir" in keys:
        raise ConfigError("run.dir cannot be swept: it is the sweep root; sweep other keys and pass one run.dir=")
    return sorted(k for k in keys if not k.startswith("hydra"))


def sweep_root(run_dir: Optional[str], *, explicit: bool) -> str:
    """The sweep root (no side effects): `run.dir` given on the command line as is (a second sweep into it
    appends to its summary); else the config's `run.dir` (`DEFAULT_SWEEP_ROOT` when null) or, when that
    holds anything (a run, an earlier sweep), the first free `<root>-2`, `<root>-3`, ..."""
    if explicit and run_dir:
        return str(run_dir)
    base = Path(run_dir or DEFAULT_SWEEP_ROOT)
    candidate, n = base, 1
    while candidate.exists() and (not candidate.is_dir() or {e.name for e in candidate.iterdir()} - HYDRA_FILES):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return str(candidate)


def _quoted(value: str) -> str:
    """`value` as a quoted string of Hydra's override grammar."""
    return "'" + value.replace("'", "\\'") + "'"


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """What `on_multirun_start` decides for the whole sweep.

    Attributes:
        root: the sweep root.
        configured: the root the config named (`root` unless that held a run or an earlier sweep).
        unswept: the keys of the sweep's overrides that are not swept (left out of the job folder names).
    """

    root: str
    configured: str
    unswept: tuple

    @property
    def hydra_overrides(self) -> list[str]:
        """The hydra overrides that give every job the root and its folder name (`hydra.job.override_dirname`)."""
        return [f"hydra.sweep.dir={_quoted(self.root)}",
                f"hydra.job.config.override_dirname.exclude_keys=[{','.join(_quoted(k) for k in self.unswept)}]"]

    @property
    def move_line(self) -> Optional[str]:
        """The stderr line of a sweep that gave way to `<root>-N`, or None."""
        if self.root == self.configured:
            return None
        folder = Path(self.configured)
        held = ("an earlier sweep" if any((folder / name).exists() for name in (*HYDRA_FILES, SUMMARY_JSON))
                else "a run" if holds_run(folder) else "other files")
        return f"sweep: {self.configured} holds {held}; this sweep writes to {self.root} (pick the folder with run.dir=)"


def plan_sweep(overrides: Sequence[str], *, run_dir: Optional[str],
               sweeper_params: Optional[Mapping[str, Any]] = None) -> SweepPlan:
    """The `SweepPlan` of a sweep's task overrides (`hydra.overrides.task` of the sweep's config: the
    command line's, sweeps unexpanded) and its composed `run.dir` (no side effects).

    Raises:
        ConfigError: `run.dir` is swept.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept = swept_keys(overrides, sweeper_params)
    keys = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}
    root = sweep_root(run_dir, explicit=run_dir_from_command_line(list(overrides)))
    configured = str(run_dir) if run_dir else DEFAULT_SWEEP_ROOT
    return SweepPlan(root=root, configured=configured, unswept=tuple(sorted(keys - set(swept))))


def sweep_job_of(hydra_cfg: Any) -> Optional[SweepJob]:
    """The `SweepJob` of a job's Hydra config node (`HydraConfig.get()` or `config.hydra`); None for a single run."""
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    overrides = tuple(hydra_cfg.overrides.task)
    unswept = set(hydra_cfg.job.config.override_dirname.exclude_keys)
    swept = sorted({k for k in (str(o).split("=", 1)[0].lstrip("+~") for o in overrides) if k not in unswept})
    return SweepJob(
        root=str(hydra_cfg.sweep.dir),
        subdir=str(hydra_cfg.job.override_dirname).replace(os.sep, "_") or "job",  # a `/` in a value: one folder
        num=int(hydra_cfg.job.num),
        overrides=overrides,
        swept=tuple(swept),
    )


def current_sweep_job() -> Optional[SweepJob]:
    """This process's current `SweepJob` from Hydra's global `HydraConfig` (None: single run, or no Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return sweep_job_of(HydraConfig.get())


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # No process group (yet / any more): torchrun's RANK is the launcher's contract, not an internal switch.
    # Under SLURM without torchrun (Hydra's submitit launcher), the task's rank is SLURM_PROCID.
    return launch_rank_and_world()[0]


try:  # Hydra is a hard dependency of the project; the guard only keeps imports cheap in odd environments.
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object


class SweepCallback(_HydraCallback):
    """Hydra callback owning the sweep (configured under `hydra.callbacks` in conf/config.yaml; module docstring).

    State (the per-process count of rejected jobs) lives on this object, which Hydra creates once
    per process and keeps for the whole multirun. Inactive in single runs (train.py handles those).

    Args:
        rank: this process's global rank; None = torch.distributed's rank (the launcher's before init).
        stream: where the one-line messages go (stderr by default).
    """

    def __init__(self, rank: Optional[int] = None, stream: Any = None) -> None:
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
        """Decide the root and the swept keys (`plan_sweep`) and hand them to every job; rank 0 says where a
        root gave way and fixes the job numbering before any job runs (`start_sweep`)."""
        hydra = config.hydra
        params = hydra.sweeper.get("params") if "sweeper" in hydra else None
        try:
            plan = plan_sweep(list(hydra.overrides.task), sweeper_params=params,
                              run_dir=OmegaConf.select(config, "run.dir", throw_on_resolution_failure=False))
        except ConfigError as err:  # the same command line on every rank: rank 0 alone prints it
            report_and_exit(f"error: {err}", rank=self._get_rank(), world_size=launch_rank_and_world()[1], symmetric=True)
        with read_write(hydra):
            hydra.sweep.dir = plan.root  # the sweeper's multirun.yaml and a launcher's own files go there
            hydra.overrides.hydra.extend(plan.hydra_overrides)  # re-applied to every job's config by Hydra
        if plan.move_line is not None:
            self._say(plan.move_line)
        if self._get_rank() == 0:
            start_sweep(plan.root)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        job = sweep_job_of(config.hydra)
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
