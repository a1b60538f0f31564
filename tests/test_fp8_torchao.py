"""The torchao surface behind precision=fp8 (`mptrain.layers.fp8_torchao`): every torchao internal it uses is
where it expects it in the installed torchao, the size rule is torchao's, and the releases accepted at start-up,
the ``fp8`` extra's range and the installed torchao agree. tests/test_fp8.py checks the arithmetic."""

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

from mptrain.layers import fp8_torchao

ROOT = Path(__file__).resolve().parents[1]


def _installed_release() -> tuple:
    import importlib.metadata

    return tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torchao")).groups())


@pytest.mark.parametrize("symbol", [f"{owner}.{name}" for owner, names in fp8_torchao.PRIVATE_SYMBOLS.items()
                                    for name in names])
def test_each_torchao_internal_used_is_there(symbol):
    """Each name of `fp8_torchao.PRIVATE_SYMBOLS` (not torchao's public API): a module's function or class with
    the parameters called positionally, in that order, or an attribute of the tensor / module it makes. A torchao
    release that moves one fails here, naming it."""
    pytest.importorskip("torchao.float8")
    owner, name = symbol.rsplit(".", 1)
    release = ".".join(map(str, _installed_release()))
    ops = fp8_torchao.load("tensorwise", True)
    if owner.endswith(".Float8TrainingTensor"):  # an attribute of the fp8 tensors the casts make
        x8 = ops.to_float8(torch.ones(2, 16), torch.tensor(2.0), torch.float8_e4m3fn, ops.input_role)
        assert isinstance(getattr(x8, name, None), torch.Tensor), f"torchao {release}: fp8 tensors have no {name}"
        return
    if owner.endswith(".Float8Linear"):  # an attribute of the module convert_to_float8_training makes
        import torchao.float8 as public

        linear = public.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16, device="meta")))[0]
        assert hasattr(linear, name), f"torchao {release}: convert_to_float8_training's Float8Linear has no {name}"
        return
    try:
        holder = importlib.import_module(owner)
    except ModuleNotFoundError:  # a class: its module's attribute
        module_name, _, class_name = owner.rpartition(".")
        holder = getattr(importlib.import_module(module_name), class_name)
    assert hasattr(holder, name), f"torchao {release} has no {owner}.{name} (mptrain.layers.fp8_torchao uses it)"
    expected = fp8_torchao.POSITIONAL_PARAMETERS.get(name)
    if expected is not None:
        target = getattr(holder, name)
        params = list(inspect.signature(target.__new__ if inspect.isclass(target) else target).parameters)
        params = params[1:] if inspect.isclass(target) else params  # __new__'s cls
        assert tuple(params[:len(expected)]) == expected, (
            f"torchao {release}: {owner}.{name} takes {params}, fp8_torchao passes {expected} by position")


def test_fp8_tensor_parts_rebuild_the_same_tensor():
    """`Float8Ops.parts` then `from_parts`: the same fp8 bits and scale, the same value in high precision."""
    pytest.importorskip("torchao.float8")
    ops = fp8_torchao.load("tensorwise", True)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    scale = ops.scale(ops.amax(x, ops.config.cast_config_input, None).float(), torch.float8_e4m3fn)
    x8 = ops.to_float8(x, scale, torch.float8_e4m3fn, ops.input_role)
    data, got_scale = ops.parts(x8)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape and torch.equal(got_scale, scale)
    assert float(scale) == pytest.approx(448.0 / float(x.float().abs().max()), rel=1e-6)
    rebuilt = ops.from_parts(data, got_scale, torch.bfloat16, ops.input_role)
    assert rebuilt.dtype == torch.bfloat16
    assert torch.equal(ops.parts(rebuilt)[0].view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(rebuilt.to_original_precision(), x8.to_original_precision())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_size_rule_is_torchao_auto_filter(recipe):
    """`fp8_gemm_decision`'s thresholds restate torchao's ``_auto_filter_for_recipe`` (the planner decides without
    torchao installed): on a grid of weight shapes ``[out, in]`` around every threshold, at tp 1, both agree."""
    pytest.importorskip("torchao.float8")
    from torchao.float8 import _auto_filter_for_recipe

    from mptrain.layers.fp8 import Fp8Recipe, gemm_runs_in_fp8

    torchao_filter = _auto_filter_for_recipe(recipe, filter_fqns=[])
    rule = Fp8Recipe(recipe=recipe)
    dims = (8, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192)
    decided = {}
    for n in dims:
        for k in dims:
            ours = gemm_runs_in_fp8(rule, global_shape=(n, k), local_shape=(n, k))
            decided[(n, k)] = ours
            assert ours == torchao_filter(torch.nn.Linear(k, n, device="meta"), "decoder.layers.0.mlp.fc1"), (n, k)
    assert any(decided.values()) and not all(decided.values())  # the grid straddles the thresholds


def test_releases_accepted_are_the_extra_and_include_the_installed_one():
    """Start-up accepts exactly `fp8_torchao.TESTED_RELEASES` (0.18.0, measured on the GPU, among them); the ``fp8``
    extra asks for the same range; the dev extra leaves torchao out (transformers imports torchao whenever it is
    installed, and torchao then logs import warnings in every process that loads a model)."""
    from omegaconf import OmegaConf

    from mptrain.errors import ConfigError
    from mptrain.layers import fp8

    tomllib = pytest.importorskip("tomllib")
    (lo_major, lo_minor), (hi_major, hi_minor) = fp8_torchao.TESTED_RELEASES
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["fp8"] == [f"torchao>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"]
    assert not [r for r in extras["dev"] if r.startswith("torchao")]
    assert fp8_torchao.TESTED_RELEASES[0] <= (0, 18) <= fp8_torchao.TESTED_RELEASES[1]
    precision = OmegaConf.create({"name": "fp8"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8, "_torchao_installed", lambda: True)
        for found in (f"{lo_major}.{lo_minor}.0", f"{hi_major}.{hi_minor}.2", f"{hi_major}.{hi_minor}.0+cu128"):
            mp.setattr(fp8, "_torchao_version", lambda found=found: found)
            fp8.check_fp8_installed(precision)
        for found in (f"{hi_major}.{hi_minor + 1}.0", f"{lo_major}.{lo_minor - 1}.1", "1.0.0"):
            mp.setattr(fp8, "_torchao_version", lambda found=found: found)
            with pytest.raises(ConfigError) as err:
                fp8.check_fp8_installed(precision)
            assert str(err.value) == (
                f"precision=fp8 needs torchao 0.18.0 or another release from {lo_major}.{lo_minor} to "
                f"{hi_major}.{hi_minor} (those its float8 internals are tested with), found {found}; install it "
                "(pip install -e .[fp8]) or pick precision=bf16")
    if importlib.util.find_spec("torchao") is not None:
        assert fp8_torchao.TESTED_RELEASES[0] <= _installed_release() <= fp8_torchao.TESTED_RELEASES[1]
