"""The top-level config, its ConfigStore registration, and a composed config turned into it (`as_config`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from mptrain.config.data import DataConfig
from mptrain.config.model import ModelConfig
from mptrain.config.optim import OptimConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.config.precision import LossScalerConfig, PrecisionConfig
from mptrain.config.schedule import ScheduleConfig
from mptrain.config.suggest import did_you_mean, known_keys
from mptrain.config.train import CheckpointConfig, DebugConfig, LoggerConfig, RunConfig, TrainConfig
from mptrain.errors import ConfigError


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


# The structured node of `Config`, built once, at import: building it from the dataclasses is most of
# `as_config`'s time (~45 ms of a first call), `register` copies it (and its group nodes) instead of building
# the same schemas again (~10 ms instead of ~110 ms), and a process forked after the import (a preloaded worker
# pool) inherits it. Never changed: `OmegaConf.merge` deep-copies its first argument, ConfigStore its node.
_SCHEMA_NODE: DictConfig = OmegaConf.structured(Config)


def register() -> None:
    """Register the schemas: `base_config` (primary) and `<group>/base_<group>` for option files."""
    from hydra.core.config_store import ConfigStore  # Hydra's import only where the entry points register

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=_SCHEMA_NODE)
    for group, schema in GROUP_SCHEMAS.items():
        # the group's node of the built schema where it is that dataclass's (the same node a build of it gives)
        same = OmegaConf.get_type(_SCHEMA_NODE, group) is schema
        cs.store(group=group, name=f"base_{group}", node=_SCHEMA_NODE[group] if same else schema)


def as_config(cfg: Any) -> Config:
    """A `Config` object from a Hydra `DictConfig` (typed or plain, e.g. a saved config.yaml) or a `Config`.

    Merging onto the structured schema makes unknown keys and wrong types fail here too. A key
    that Hydra's ``+key=value`` forced into a typed group survives that merge, so unknown keys are
    also looked for in the result (`reject_unknown_keys`).

    Raises:
        omegaconf.errors.ValidationError / ConfigKeyError: unknown key or wrong type.
        ConfigError: a key added with ``+`` that the schema does not have (e.g. a misspelt key); an
            interpolation that does not resolve (a missing key, an unset ``oc.env`` variable).
    """
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"as_config: expected a DictConfig, dict or Config, got {type(cfg).__name__}")
    merged = OmegaConf.merge(_SCHEMA_NODE, cfg)
    try:
        obj = OmegaConf.to_object(merged)
    except InterpolationResolutionError as err:  # ${...} naming a missing key or an unset variable
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        error = ConfigError(f"{err.full_key}: {reason}; fix the ${{...}} interpolation (or write a literal $ as \\$)")
        error.symmetric = False  # ${oc.env:X} may resolve on one node and not on another: each failing rank prints
        raise error from None
    reject_unknown_keys(obj, "")
    return obj


def config_to_container(cfg: Any) -> dict:
    """The config as plain dicts / lists: every schema field and, on component nodes, the keys a user
    added with ``+`` (their target's own keywords, e.g. ``optim.alpha``), which
    ``OmegaConf.structured(cfg)`` would drop. What config.yaml, a checkpoint's meta and the loggers record.

    Args:
        cfg: a `Config` (or anything `as_config` takes).
    """
    return _to_container(as_config(cfg))


def _to_container(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: _to_container(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out.update({k: _to_container(v) for k, v in vars(obj).items() if k not in out})  # keys added with `+`
        return out
    if isinstance(obj, dict):
        return {k: _to_container(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_container(v) for v in obj]
    return obj


def reject_unknown_keys(obj: Any, prefix: str, *, root: Any = None) -> None:
    """Raise ConfigError for an attribute of a schema dataclass that is not one of its fields.

    A component node (a schema with a ``_target_`` field, `mptrain.components`) keeps such keys:
    they are its target's own keywords (``+optim.alpha=0.95`` for torch.optim.RMSprop), checked
    against the target's signature at start-up instead (`mptrain.components.resolve`).
    ``root``: the whole config ``obj`` sits in at ``prefix`` (None: ``obj`` is it), whose keys the message's
    "did you mean" is chosen from (`mptrain.config.suggest`: ``+num_layers=4`` -> ``model.num_layers``)."""
    root = obj if root is None else root
    fields = {f.name for f in dataclasses.fields(obj)}
    for key in vars(obj):
        if key not in fields and "_target_" not in fields:
            where = prefix.rstrip(".") or "the top level"
            raise ConfigError(f"{prefix}{key}: unknown config key (misspelt? `+` adds keys the schema does not have); "
                              f"{did_you_mean(prefix + key, known_keys(root))}"
                              f"valid keys of {where}: {', '.join(sorted(fields))}")
    for name in fields:
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            reject_unknown_keys(value, f"{prefix}{name}.", root=root)
