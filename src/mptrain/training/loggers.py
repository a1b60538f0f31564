"""Experiment loggers selected by `logger=none | tensorboard | wandb` (a registry with an exhaustive lookup).

Only rank 0 logs (the loss reaches rank 0 from the last stage); other ranks get `NullLogger`.
Optional packages are imported only when selected: `torch.utils.tensorboard` (needs the
`tensorboard` package) and `wandb`. Whether the package is importable is checked on every rank
before anything is created, so a missing package is the same one-line `ConfigError` everywhere.

wandb: `mode` from `logger.mode` (offline by default: `wandb sync <run_dir>/wandb/offline-run-*`
uploads later; disabled gives no-op objects), files under the run folder, one wandb run per
sweep job: `finish()` at the end of every job (a multirun in one process otherwise merges jobs
into one run, wandb#1314).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

from mptrain.errors import ConfigError


class ExperimentLogger(Protocol):
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...


def _scalars(metrics: Mapping[str, Any]) -> dict:
    """Numeric entries only (None, strings and bools of metrics rows are skipped)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class NullLogger:
    """`logger=none`, and every rank but 0."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class TensorBoardLogger:
    """`logger=tensorboard`: scalars under `<run_dir>/tensorboard`, tag `<split>/<key>`."""

    package = "tensorboard"

    def __init__(self, logger_cfg: Any, *, run_dir: Path, config: Optional[dict] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if config is not None:
            import json

            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        split = metrics.get("split", "train")
        for key, value in _scalars(metrics).items():
            if key != "iteration":
                self.writer.add_scalar(f"{split}/{key}", value, step)

    def finish(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbLogger:
    """`logger=wandb`: one wandb run per job, files under `<run_dir>/wandb`, keys `<split>/<key>`."""

    package = "wandb"

    def __init__(self, logger_cfg: Any, *, run_dir: Path, config: Optional[dict] = None) -> None:
        import wandb

        self.run = wandb.init(
            project=logger_cfg.project,
            entity=logger_cfg.entity,
            name=logger_cfg.run_name or Path(run_dir).name,
            group=logger_cfg.group,
            mode=logger_cfg.mode,
            dir=str(run_dir),
            config=config,
        )

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        split = metrics.get("split", "train")
        self.run.log({f"{split}/{k}": v for k, v in _scalars(metrics).items() if k != "iteration"}, step=step)

    def finish(self) -> None:
        self.run.finish()


LOGGERS: dict[str, Any] = {"none": NullLogger, "tensorboard": TensorBoardLogger, "wandb": WandbLogger}


def logger_class(name: str) -> Any:
    """The class registered for `logger.name`.

    Raises:
        ConfigError: unknown name (listing the valid ones).
    """
    try:
        return LOGGERS[name]
    except KeyError:
        raise ConfigError(f"logger.name: unknown option {name!r}; valid: {', '.join(LOGGERS)}; pick logger=<option>") from None


def build_logger(logger_cfg: Any, *, run_dir: Path, rank: int, config: Optional[dict] = None) -> ExperimentLogger:
    """The experiment logger of this rank (`NullLogger` except on rank 0 with a real logger selected).

    Args:
        logger_cfg: the `logger` config node (name, project, mode, entity, run_name, group).
        run_dir: the run folder (logger files go under it).
        rank: global rank.
        config: the resolved config as plain containers (recorded by the logger), optional.
    Raises:
        ConfigError (on every rank): unknown logger name, or its package is not installed.
    """
    cls = logger_class(logger_cfg.name)
    package = getattr(cls, "package", None)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"logger={logger_cfg.name} needs the {package!r} package, which is not installed; "
            f"pip install {package}, or pick logger=none"
        )
    if rank != 0 or cls is NullLogger:
        return NullLogger()
    return cls(logger_cfg, run_dir=Path(run_dir), config=config)
