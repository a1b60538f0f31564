"""Experiment loggers: components built from `logger.loggers.<key>._target_` (DESIGN.md §1 "Components").

    logger=none                        # no experiment logger (metrics.jsonl and train.log are always written)
    logger=wandb                       # mptrain.training.loggers.WandbLogger
    logger=tensorboard                 # mptrain.training.loggers.TensorBoardLogger
    logger=[wandb,tensorboard]         # both (Hydra selects several options of one group)
    +logger.loggers.csv._target_=mptrain_plugins.loggers.CSVLogger      # a user's logger, besides the others

`logger.loggers` maps a key of the user's choosing to one component node; every node is built,
so several loggers run side by side. The shared keys of the `logger` node (`project`, `entity`,
`run_name`, `group`, `tags`, `mode`, `tensorboard_dir`) reach each target whose constructor takes them (as
`project`, `entity`, `name`, `group`, `tags`, `mode`, `log_dir`); a node's own key wins over a shared one.

What the trainer guarantees (the `MetricsLogger` interface):
- built on rank 0 only, after the run folder exists and the checkpoint (if any) is loaded; the
  other ranks build nothing and import nothing. Every rank runs the start-up check
  (`check_logger_config`: import, methods, keywords, required packages) inside
  `validate_config`, before any collective.
- `log_metrics(metrics, step)`: one call per metrics.jsonl row (every iteration, not paced by
  `train.log_interval`), with the row's numbers under `<split>/<key>` (`logged_metrics`):
  `train/lm_loss`, `train/lr`, `train/grad_norm`, `train/loss_scale`, `train/tokens_per_s`, ...,
  `valid/lm_loss`, `valid/ppl`, `test/lm_loss`, `test/ppl`; the iteration is the step (never a
  metric). Steps never decrease within one process; a `valid` row shares its step with the train
  row of the same iteration (and comes first at iteration 0).
- `finish()`: once at the end of the job, also after a failure.
- Resume: `start_iteration` (the checkpoint's iteration) is passed to the constructor;
  `WandbLogger` continues the same wandb run (its id is kept in `<run_dir>/wandb/run_id`),
  `TensorBoardLogger` appends to the same log dir and hides the steps after the checkpoint that
  the first attempt logged (`purge_step`).

wandb: offline by default (`logger.mode`: online | offline | disabled; `wandb sync
<run_dir>/wandb/offline-run-*` uploads an offline run later), files under the run folder, its
console capture and code saving off (train.log has the console), one wandb run per job and
`finish()` at the end of every job (a multirun in one process otherwise merges jobs, wandb#1314).
"""

from __future__ import annotations

import importlib.util
import json
import math
import secrets
import string
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence

from mptrain.components import ComponentKind, accepted_keywords, build, resolve
from mptrain.errors import ConfigError

WANDB_MODES = ("online", "offline", "disabled")
# (not `config`: hydra.utils.instantiate takes its node under that name)
RUNTIME_KEYWORDS = ("run_dir", "run_config", "start_iteration")
# The shared `logger.*` keys and the constructor keyword each one becomes (passed only when accepted).
SHARED_KEYWORDS = {"project": "project", "entity": "entity", "run_name": "name", "group": "group", "tags": "tags",
                   "mode": "mode", "tensorboard_dir": "log_dir"}
# metrics.jsonl keys that are not metrics: the split becomes the prefix, the iteration the step.
NOT_LOGGED = ("split", "iteration", "skipped_iter")


class MetricsLogger(Protocol):
    """An experiment logger (rank 0 only).

    Constructor: any keywords of its own (from its config node), plus those of the runtime
    keywords it accepts: ``run_dir`` (Path, the run folder, exists), ``run_config`` (dict, the
    resolved config as plain containers: the run's config), ``start_iteration`` (int, 0 for a
    fresh run, the checkpoint's iteration on resume).
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record one metrics.jsonl row.

        Args:
            metrics: ``<split>/<key>`` → float, e.g. ``{"train/lm_loss": 6.93, "train/lr": 3e-4}``;
                units as metrics.jsonl (lr, loss in nats per token, tokens/s, TFLOP/s per GPU,
                GiB); keys whose value is null in metrics.jsonl are absent.
            step: the iteration (completed optimizer steps, from 1; 0 = before training).
        """

    def finish(self) -> None:
        """End of the job: flush and close (called once, also after a failure)."""


LOGGER_KIND = ComponentKind("logger", methods=("log_metrics", "finish"), runtime_keywords=RUNTIME_KEYWORDS,
                            interface=MetricsLogger)


def logged_metrics(row: Mapping[str, Any]) -> dict:
    """A metrics.jsonl row as the loggers get it: numbers under ``<split>/<key>``.

    The split, the iteration (the step) and the ``skipped_iter`` flag (``skipped_iters_total``
    counts it) are not metrics; None and non-finite values (null in metrics.jsonl) are left out.

    Example: ``{"split": "valid", "iteration": 10, "lm_loss": 2.5, "ppl": 12.18}`` →
    ``{"valid/lm_loss": 2.5, "valid/ppl": 12.18}``.
    """
    split = row["split"]
    out = {}
    for key, value in row.items():
        if key in NOT_LOGGED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[f"{split}/{key}"] = value
    return out


def _shared_keywords(logger_cfg: Any) -> dict:
    shared = {kw: getattr(logger_cfg, key) for key, kw in SHARED_KEYWORDS.items() if hasattr(logger_cfg, key)}
    if shared.get("log_dir") is not None:
        # Megatron's --tensorboard-dir: a relative path is under the working directory, not the run folder
        shared["log_dir"] = str(Path(shared["log_dir"]).absolute())
    return shared


def _nodes(logger_cfg: Any) -> dict:
    return dict(getattr(logger_cfg, "loggers", None) or {})


def check_logger_config(cfg: Any) -> None:
    """Start-up check of the `logger` node (pure: the config only; `validate_config` calls it on every rank).

    Raises:
        ConfigError: `logger.mode` not online | offline | disabled; a `logger.loggers.<key>` node
            without `_target_`, whose target does not import, lacks `log_metrics` / `finish`, gets a
            keyword it does not take, or needs a package that is not installed (e.g. wandb);
            `logger.tensorboard_dir` set where no logger takes ``log_dir`` (no TensorBoard logger).
    """
    lg = cfg.logger
    if lg.mode not in WANDB_MODES:
        raise ConfigError(f"logger.mode: unknown option {lg.mode!r}; valid: {', '.join(WANDB_MODES)}; "
                          "set logger.mode to one of them")
    takes_log_dir = False
    for key, node in _nodes(lg).items():
        where = f"logger.loggers.{key}"
        if not isinstance(node, Mapping) or "_target_" not in node:
            raise ConfigError(f"{where}: expected a component node with _target_ (e.g. "
                              f"+{where}._target_=mptrain.training.loggers.TensorBoardLogger), got {node!r}")
        target, kwargs = resolve(where, node, LOGGER_KIND, mapped=_shared_keywords(lg))
        takes_log_dir = takes_log_dir or "log_dir" in kwargs
        for package in getattr(target, "required_packages", ()):
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"{where}._target_={node['_target_']} needs the {package!r} package, which is not "
                                  f"installed; pip install {package} (or pip install -e .[dev]), or pick logger=none")
    if lg.tensorboard_dir is not None and not takes_log_dir:
        raise ConfigError(f"logger.tensorboard_dir={lg.tensorboard_dir} has no effect without a TensorBoard logger; "
                          "add logger=tensorboard (or logger=[wandb,tensorboard]), or set logger.tensorboard_dir=null")


class LoggerGroup:
    """The loggers of this rank side by side (empty on ranks other than 0); itself a `MetricsLogger`."""

    def __init__(self, loggers: Sequence[Any] = ()) -> None:
        self.loggers = list(loggers)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def finish(self) -> None:
        """Finish every logger, even when one raises (the first error is re-raised after)."""
        first: Optional[BaseException] = None
        for lg in self.loggers:
            try:
                lg.finish()
            except Exception as err:  # noqa: BLE001 - the others still flush
                first = first or err
        self.loggers = []
        if first is not None:
            raise first


def build_loggers(logger_cfg: Any, *, rank: int, run_dir: Path, run_config: Optional[dict] = None,
                  start_iteration: int = 0) -> LoggerGroup:
    """The loggers of `logger.loggers` (rank 0), or an empty group (other ranks: nothing imported).

    Args:
        logger_cfg: the `logger` config node (checked by `check_logger_config`).
        rank: global rank.
        run_dir: the run folder.
        run_config: the resolved config (plain containers), the run's config for the loggers.
        start_iteration: 0, or the checkpoint's iteration on resume.
    Raises:
        ConfigError: see `check_logger_config`; a target that rejects its arguments.
    """
    if rank != 0:
        return LoggerGroup()
    runtime_all = {"run_dir": Path(run_dir), "run_config": run_config, "start_iteration": start_iteration}
    built = []
    for key, node in _nodes(logger_cfg).items():
        where = f"logger.loggers.{key}"
        target, _ = resolve(where, node, LOGGER_KIND, mapped=_shared_keywords(logger_cfg))
        accepted = accepted_keywords(target)
        runtime = {k: v for k, v in runtime_all.items() if accepted is None or k in accepted}
        built.append(build(where, node, LOGGER_KIND, runtime=runtime, mapped=_shared_keywords(logger_cfg)))
    return LoggerGroup(built)


class TensorBoardLogger:
    """`logger=tensorboard`: scalars under `logger.tensorboard_dir`, by default `<run_dir>/tensorboard`
    (torch.utils.tensorboard), tag = metric name.

    Args:
        run_dir, run_config, start_iteration: runtime (see `MetricsLogger`).
        log_dir: the event folder (``logger.tensorboard_dir``, made absolute against the working directory;
            or the node's own ``log_dir``, a relative one under run_dir); null = `<run_dir>/tensorboard`.
        flush_secs: seconds between flushes of the event file.
    """

    required_packages = ("tensorboard",)

    def __init__(self, *, run_dir: Path, run_config: Optional[dict] = None, start_iteration: int = 0,
                 log_dir: Optional[str] = None, flush_secs: int = 30) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / (log_dir or "tensorboard")
        # On resume, events the first attempt logged after the checkpoint are hidden by TensorBoard
        # (the redone iterations are logged again): purge_step = the first iteration of this attempt.
        purge = start_iteration + 1 if start_iteration > 0 else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge, flush_secs=flush_secs)
        if run_config is not None and start_iteration == 0:
            self.writer.add_text("config", "```\n" + json.dumps(run_config, indent=1, default=str) + "\n```", 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def finish(self) -> None:
        self.writer.flush()
        self.writer.close()


def _new_run_id() -> str:
    """A wandb-style run id: 8 characters of [a-z0-9] (wandb's own generator moved between releases)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbLogger:
    """`logger=wandb`: one wandb run per training run, continued on resume; files under `<run_dir>/wandb`.

    The run id is written to `<run_dir>/wandb/run_id` on the first start and read back by every
    resumed attempt (wandb ``resume`` = `resume`), so one training run's curves stay in one wandb run.

    Args:
        run_dir, run_config, start_iteration: runtime (see `MetricsLogger`); `run_config` becomes the run's config.
        project, entity, name, group, tags, mode: wandb.init's (from `logger.*`); name null = the
            run folder's name; mode online | offline | disabled.
        id: the wandb run id; null = `<run_dir>/wandb/run_id`, or a new one written there.
        resume: wandb.init's `resume` for a known id: allow (default) | must | never.
        settings: extra `wandb.Settings` fields, e.g. ``{x_disable_stats: true}`` (no system metrics).
    """

    required_packages = ("wandb",)
    ID_FILE = "run_id"

    def __init__(self, *, run_dir: Path, run_config: Optional[dict] = None, start_iteration: int = 0,
                 project: str = "mptrain", entity: Optional[str] = None, name: Optional[str] = None,
                 group: Optional[str] = None, tags: Optional[Sequence[str]] = None, mode: str = "offline",
                 id: Optional[str] = None, resume: str = "allow", settings: Optional[Mapping[str, Any]] = None) -> None:
        import wandb

        run_dir = Path(run_dir)
        wandb_dir = run_dir / "wandb"
        wandb_dir.mkdir(parents=True, exist_ok=True)
        id_file = wandb_dir / self.ID_FILE
        if id is None:
            id = id_file.read_text().strip() if id_file.exists() else _new_run_id()
        id_file.write_text(id + "\n")
        # console="off": train.log holds the console; wandb's capture would also wrap the progress bar's stream
        base = {"console": "off", "save_code": False, "silent": True}
        self.run = wandb.init(
            dir=str(run_dir), id=id, resume=resume, project=project, entity=entity, name=name or run_dir.name,
            group=group, tags=list(tags) if tags else None, mode=mode, config=run_config,
            settings=wandb.Settings(**{**base, **dict(settings or {})}),
        )

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()
