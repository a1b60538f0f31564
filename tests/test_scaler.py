"""Loss scalers: the dynamic scaler's state machine as a table, the constant scaler, the config registry."""

import math
import types

import pytest
import torch

from mptrain.config.precision import LossScalerConfig
from mptrain.errors import ConfigError
from mptrain.precision.scaler import (
    ConstantLossScaler,
    DynamicLossScaler,
    build_loss_scaler,
    scaler_label,
)

# What conf/loss_scaler/<name>.yaml sets (test_hydra_composes_every_scaler_and_precision_option composes them).
TARGETS = {name: f"mptrain.precision.scaler.{fn}" for name, fn in (
    ("auto", "auto_loss_scaler"), ("dynamic", "DynamicLossScaler"), ("constant", "ConstantLossScaler"),
    ("none", "no_loss_scaler"))}

# initial 16, floor 2, grow x2 after 3 clean steps, back off x0.5 once 2 overflows happened since the last growth.
TABLE_ARGS = dict(initial_scale=16.0, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2)

# (found_inf, scale after update, growth_tracker, hysteresis_tracker)   -- Megatron DynamicGradScaler semantics
DYNAMIC_TABLE = [
    (False, 16.0, 1, 2),
    (False, 16.0, 2, 2),
    (False, 32.0, 0, 2),   # growth exactly at growth_interval = 3 clean steps
    (True, 32.0, 0, 1),    # first overflow: tolerated by hysteresis, no backoff (the step is still skipped)
    (False, 32.0, 1, 1),   # clean steps do NOT reset the hysteresis tracker
    (False, 32.0, 2, 1),
    (True, 16.0, 0, 0),    # second overflow since the last growth (not consecutive): back off
    (True, 8.0, 0, -1),    # hysteresis exhausted: every overflow backs off until the next growth
    (True, 4.0, 0, -2),
    (True, 2.0, 0, -3),    # reaches min_scale
    (True, 2.0, 0, -4),    # floored at min_scale
    (False, 2.0, 1, -4),
    (False, 2.0, 2, -4),
    (False, 4.0, 0, 2),    # growth resets the hysteresis tracker (the only reset)
    (True, 4.0, 0, 1),     # hysteresis tolerates one overflow again
    (True, 2.0, 0, 0),
    (False, 2.0, 1, 0),
    (True, 2.0, 0, -1),    # growth tracker reset by the overflow; floor holds
]


def _state(s: DynamicLossScaler):
    return (s.scale.item(), s.growth_tracker, s.hysteresis_tracker)


def test_dynamic_scaler_table():
    s = DynamicLossScaler(**TABLE_ARGS)
    assert _state(s) == (16.0, 0, 2)
    for i, (found_inf, scale, growth, hyst) in enumerate(DYNAMIC_TABLE):
        s.update(found_inf)
        assert _state(s) == (scale, growth, hyst), f"row {i}: {_state(s)}"
        assert s.inv_scale.item() == 1.0 / scale  # powers of two: exact in float32
        assert s.scale.dtype == torch.float32 and s.scale.shape == (1,)


@pytest.mark.parametrize("split", [0, 3, 7, 11, 14])
def test_dynamic_scaler_state_dict_round_trip(split):
    ref = DynamicLossScaler(**TABLE_ARGS)
    for found_inf, *_ in DYNAMIC_TABLE[:split]:
        ref.update(found_inf)
    saved = ref.state_dict()
    assert set(saved) == {"scale", "growth_tracker", "hysteresis_tracker"}
    resumed = DynamicLossScaler(**TABLE_ARGS)
    resumed.load_state_dict(saved)
    for found_inf, scale, growth, hyst in DYNAMIC_TABLE[split:]:
        resumed.update(found_inf)
        assert _state(resumed) == (scale, growth, hyst)


def test_megatron_defaults_start_at_2_pow_32_and_back_off_after_two_overflows():
    s = build_loss_scaler(LossScalerConfig(), "fp16")  # the schema's default _target_: auto_loss_scaler
    assert isinstance(s, DynamicLossScaler)
    assert s.scale.item() == 2.0**32
    s.update(True)
    assert s.scale.item() == 2.0**32
    s.update(True)
    assert s.scale.item() == 2.0**31
    for _ in range(999):
        s.update(False)
    assert s.scale.item() == 2.0**31
    s.update(False)
    assert s.scale.item() == 2.0**32


def test_constant_scaler():
    s = ConstantLossScaler(1024.0)
    for found_inf in (True, True, True, False):
        s.update(found_inf)
        assert s.scale.item() == 1024.0
        assert s.inv_scale.item() == 1.0 / 1024.0
    assert not s.dynamic
    other = ConstantLossScaler(8.0)
    other.load_state_dict(s.state_dict())
    assert other.scale.item() == 1024.0
    with pytest.raises(ConfigError, match="scale=0"):
        ConstantLossScaler(0.0)


def test_inv_scale_of_non_power_of_two():
    s = ConstantLossScaler(3.0)
    assert math.isclose(s.inv_scale.item(), 1 / 3, rel_tol=1e-7)  # float32 rounding of 1/3 (eps 6e-8)


@pytest.mark.parametrize(
    "name, precision, expected",
    [
        ("auto", "fp16", DynamicLossScaler),
        ("auto", "bf16", None),
        ("auto", "fp32", None),
        ("dynamic", "fp16", DynamicLossScaler),
        ("constant", "fp16", ConstantLossScaler),
        ("constant", "bf16", ConstantLossScaler),
        ("constant", "fp32", ConstantLossScaler),
        ("none", "bf16", None),
        ("none", "fp32", None),
    ],
)
def test_build_loss_scaler_by_target(name, precision, expected):
    s = build_loss_scaler(LossScalerConfig(_target_=TARGETS[name], name=name), precision)
    if expected is None:
        assert s is None
    else:
        assert type(s) is expected


@pytest.mark.parametrize(
    "name, precision, match",
    [
        ("none", "fp16", r"^loss_scaler: precision=fp16 with loss_scaler=none \(_target_=mptrain.precision.scaler."
                         r"no_loss_scaler\) would underflow"),
        ("dynamic", "bf16", r"loss_scaler=dynamic \(_target_=mptrain.precision.scaler.DynamicLossScaler\) is for "
                            r"precision=fp16"),
        ("bogus", "fp16", r"^loss_scaler._target_=mptrain.precision.scaler.bogus: module mptrain.precision.scaler has no "
                          r"bogus; fix the dotted path"),
        ("auto", "fp4", r"unknown precision='fp4'; pick one of fp32, bf16, fp16, fp8"),
    ],
)
def test_rejected_pairs(name, precision, match):
    target = TARGETS.get(name, f"mptrain.precision.scaler.{name}")
    with pytest.raises(ConfigError, match=match):
        build_loss_scaler(LossScalerConfig(_target_=target, name=name), precision)
    with pytest.raises(ConfigError, match=match):  # a partial namespace gets the schema's other defaults
        build_loss_scaler(types.SimpleNamespace(_target_=target, name=name), precision)


def test_the_label_does_not_select():
    """``loss_scaler.name`` is a label: `_target_` alone decides what is built (no name -> class table)."""
    s = build_loss_scaler(LossScalerConfig(_target_=TARGETS["constant"], name="dynamic", scale=8.0), "fp16")
    assert (type(s), s.scale.item(), scaler_label(s)) == (ConstantLossScaler, 8.0, "constant")
    with pytest.raises(ConfigError, match=r"^loss_scaler._target_ is missing"):
        build_loss_scaler(types.SimpleNamespace(name="constant"), "fp16")


@pytest.mark.parametrize("name, key, value", [("constant", "initial_scale", 0.0), ("dynamic", "scale", 8.0),
                                             ("auto", "scale", 8.0), ("none", "hysteresis", 4)])
def test_a_key_the_scaler_does_not_take_is_refused(name, key, value):
    """One schema for every scaler: a key moved off its default that the target does not take would be dropped."""
    precision = "fp16" if name != "none" else "fp32"
    with pytest.raises(ConfigError) as info:
        build_loss_scaler(LossScalerConfig(_target_=TARGETS[name], name=name, **{key: value}), precision)
    assert str(info.value) == (f"loss_scaler.{key}={value} is not used by loss_scaler={name} (_target_={TARGETS[name]}); "
                               "drop the key, or pick the scaler that takes it (dynamic: initial_scale, min_scale, "
                               "growth_factor, backoff_factor, growth_interval, hysteresis; constant: scale)")
    built = build_loss_scaler(LossScalerConfig(_target_=TARGETS[name], name=name), precision)  # defaults: accepted
    assert (built is None) == (name == "none")


@pytest.mark.parametrize(
    "override, match",
    [
        ({"min_scale": 0.0}, "min_scale=0.0 must be > 0"),
        ({"min_scale": 32.0}, "must be <= initial_scale"),
        ({"growth_factor": 1.0}, "growth_factor=1.0 must be > 1"),
        ({"backoff_factor": 1.0}, "backoff_factor=1.0 must be in"),
        ({"growth_interval": 0}, "growth_interval=0 must be >= 1"),
        ({"hysteresis": 0}, "hysteresis=0 must be >= 1"),
    ],
)
def test_dynamic_scaler_rejects_bad_values(override, match):
    with pytest.raises(ConfigError, match=match):
        DynamicLossScaler(**{**TABLE_ARGS, **override})


def test_hydra_composes_every_scaler_and_precision_option():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from mptrain.config import schema

    schema.register()
    GlobalHydra.instance().clear()
    conf_dir = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        built = {}
        for precision in ("fp32", "bf16", "fp16"):
            for scaler in ("auto", "dynamic", "constant", "none"):
                cfg = compose("config", overrides=[f"precision={precision}", f"loss_scaler={scaler}"])
                obj = OmegaConf.to_object(cfg.loss_scaler)
                assert obj.name == scaler and obj._target_ == TARGETS[scaler] and cfg.precision.name == precision
                try:
                    built[(precision, scaler)] = type(build_loss_scaler(obj, precision)).__name__
                except ConfigError:
                    built[(precision, scaler)] = "ConfigError"
        dyn = compose("config", overrides=["loss_scaler=dynamic"]).loss_scaler
        assert (dyn.initial_scale, dyn.min_scale, dyn.growth_factor, dyn.backoff_factor, dyn.growth_interval,
                dyn.hysteresis, dyn.max_consecutive_skips) == (2.0**32, 1.0, 2.0, 0.5, 1000, 2, 100)
    GlobalHydra.instance().clear()
    assert built == {
        ("fp32", "auto"): "NoneType", ("fp32", "dynamic"): "ConfigError", ("fp32", "constant"): "ConstantLossScaler",
        ("fp32", "none"): "NoneType", ("bf16", "auto"): "NoneType", ("bf16", "dynamic"): "ConfigError",
        ("bf16", "constant"): "ConstantLossScaler", ("bf16", "none"): "NoneType",
        ("fp16", "auto"): "DynamicLossScaler", ("fp16", "dynamic"): "DynamicLossScaler",
        ("fp16", "constant"): "ConstantLossScaler", ("fp16", "none"): "ConfigError",
    }
