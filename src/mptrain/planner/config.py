"""The `plan` / `check` primary config: the training config plus `world_size`, `hardware`, `format`.

Registered as `base_plan` in Hydra's ConfigStore (beside `schema.register()`'s `base_config`), so
`conf/plan.yaml` composes the same config groups as `conf/config.yaml` and the planner sees exactly
what `train.py` would.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from mptrain.config.schema import Config, reject_unknown_keys
from mptrain.errors import ConfigError
from mptrain.layers.params import DEFAULT_PEAK_TFLOPS
from mptrain.resources import conf_dir

CONF_DIR = conf_dir()
FORMATS = ("table", "json")


@dataclasses.dataclass
class HardwareConfig:
    """ASSUMED accelerator numbers (`gpu_memory_gib` less `memory_headroom_gib` decides `fits`; the rest rank layouts).

    The planner's one hardware record: `plan_layout` / `plan` take it as ``hw``."""

    gpu_memory_gib: float = 80.0
    """Memory per GPU in GiB (2**30 bytes)."""
    memory_headroom_gib: float = 4.0
    """GiB of `gpu_memory_gib` a layout must leave free to fit; one whose planned total falls inside it is
    `tight` (it may run out of memory). It covers what the planner does not model: the CUDA context (outside
    torch's allocator, ~0.5 GiB a process), NCCL's communicator buffers (tens to hundreds of MiB per group),
    cuBLAS workspaces and the caching allocator's fragmentation (a few % of the peak). 4 GiB is 5 % of an
    80 GiB H100; 0 judges by the planned total alone. Must be >= 0 and < gpu_memory_gib."""
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    """Dense bf16 peak per GPU, TFLOP/s (default: H100/H200 SXM, `mptrain.layers.params.DENSE_BF16_PEAK_TFLOPS`)."""
    assumed_mfu: float = 0.45
    """Share of the peak the model math is assumed to reach (step-time estimate only)."""
    gpus_per_node: int = 8
    intra_node_gb_per_s: float = 400.0
    """Bus bandwidth inside a node (NVLink), GB/s."""
    inter_node_gb_per_s: float = 50.0
    """Bus bandwidth between nodes, GB/s."""


@dataclasses.dataclass
class PlanConfig(Config):
    world_size: int = 8
    """GPUs (processes) to plan for."""
    hardware: HardwareConfig = dataclasses.field(default_factory=HardwareConfig)
    format: str = "table"
    """table | json."""
    top: Optional[int] = 25
    """Rows of the table (null = all); json prints every layout."""


def register_plan() -> None:
    """Register `base_config`, the groups (schema.register) and `base_plan`."""
    from hydra.core.config_store import ConfigStore

    from mptrain.config.schema import register

    register()
    ConfigStore.instance().store(name="base_plan", node=_plan_node())


@functools.lru_cache(maxsize=None)
def _plan_node() -> DictConfig:
    """The structured node of `PlanConfig`, built once per process: building it is most of `register_plan`'s
    time (~60 ms a call, and `compose_plan` registers at every call); ConfigStore stores a copy of it."""
    return OmegaConf.structured(PlanConfig)


def compose_plan(overrides: list) -> object:
    """Compose `conf/plan.yaml` with ``overrides`` (tests and scripts; the CLI uses hydra.main)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_plan()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="plan", overrides=list(overrides))


def check_plan_keys(c: PlanConfig) -> None:
    """What `plan` and `check` refuse alike before they run, as `train.py` does: a key added with ``+`` that the
    schema (or, under ``precision``, its wrapper: `wrapper_target`) does not take, a ``hardware`` number out of
    range, and ``world_size`` < 1.

    Raises:
        ConfigError: one line naming the key.
    """
    from mptrain.distributed.distrib_optimizer import wrapper_target
    from mptrain.distributed.strategy import sharding_strategy

    reject_unknown_keys(c, "")
    wrapper_target(c.precision, c.parallel.use_distributed_optimizer, sharding_strategy=sharding_strategy(c.parallel))
    hw = c.hardware
    for key in ("gpu_memory_gib", "peak_tflops", "intra_node_gb_per_s", "inter_node_gb_per_s"):
        if getattr(hw, key) <= 0:
            raise ConfigError(f"hardware.{key}={getattr(hw, key)} must be > 0")
    if not 0 <= hw.memory_headroom_gib < hw.gpu_memory_gib:
        raise ConfigError(f"hardware.memory_headroom_gib={hw.memory_headroom_gib} must be >= 0 and less than "
                          f"hardware.gpu_memory_gib={hw.gpu_memory_gib}")
    if not 0 < hw.assumed_mfu <= 1 or hw.gpus_per_node < 1:
        raise ConfigError(f"hardware.assumed_mfu={hw.assumed_mfu} must be in (0, 1] and "
                          f"hardware.gpus_per_node={hw.gpus_per_node} >= 1")
    if c.world_size < 1:
        raise ConfigError(f"world_size={c.world_size} must be >= 1")
