"""The top-level config and its ConfigStore registration."""

from __future__ import annotations

import dataclasses
from typing import Any

from mptrain.config.data import DataConfig
from mptrain.config.model import ModelConfig
from mptrain.config.optim import OptimConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.config.precision import LossScalerConfig, PrecisionConfig
from mptrain.config.schedule import ScheduleConfig
from mptrain.config.train import CheckpointConfig, DebugConfig, LoggerConfig, RunConfig, TrainConfig


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    loss_scaler: LossScalerConfig = dataclasses.field(default_factory=LossScalerConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    logger: LoggerConfig = dataclasses.field(default_factory=LoggerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    debug: DebugConfig = dataclasses.field(default_factory=DebugConfig)


GROUP_SCHEMAS: dict[str, Any] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "schedule": ScheduleConfig,
    "precision": PrecisionConfig,
    "loss_scaler": LossScalerConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logger": LoggerConfig,
}


def register() -> None:
    """Register the schemas: `base_config` (primary) and `<group>/base_<group>` for option files.

    Also registers the `mptrain_sweep_root` resolver used by conf/config.yaml's `hydra.sweep.dir`
    (`run.dir`, or `outputs/multirun` when null; see `mptrain.training.sweep`).
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from mptrain.training.sweep import sweep_root

    OmegaConf.register_new_resolver("mptrain_sweep_root", sweep_root, replace=True)

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
