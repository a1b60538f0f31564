"""The model provider and the layer spec tree are components: each node is selected by `_target_`
from the config, a user's class plugs in, and a bad target is one ConfigError naming its key."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from harness import run_distributed
from mptrain.config.schema import as_config
from mptrain.training.validate import validate_config
from mptrain.errors import ConfigError
from mptrain.layers.gpt import GPTModel
from mptrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mptrain.layers.transformer import TransformerLayer
from train_utils import compose, read_rows, run_job

CORE = "model.transformer_layer.submodules.self_attention.submodules.core_attention"
SUBS = "model.transformer_layer.submodules"
SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "model.vocab_size=64"]


# --- user classes (importable as test_model_components.<Name>: tests/ is on the path) ---------------
class MyGPT(GPTModel):
    """A user's model provider: GPTModel with one extra keyword of its own."""

    def __init__(self, *, tag: str = "", **kwargs):
        super().__init__(kwargs.pop("config"), kwargs.pop("groups"), **kwargs)
        self.tag = tag


class MyLayer(TransformerLayer):
    pass


class MyColumn(ColumnParallelLinear):
    pass


class MyRow(RowParallelLinear):
    pass


class MySkipBiasColumn(ColumnParallelLinear):
    """Returns its bias for the parent to add (Megatron's skip_bias_add)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, skip_bias_add=True, **kwargs)


class MySkipBiasRow(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, skip_bias_add=True, **kwargs)


class MyGELU(torch.nn.Module):
    """A user's activation with no __init__ of its own (Module's takes **kwargs only to reject them)."""

    def forward(self, x):
        return torch.nn.functional.gelu(x)


def _outputs(rank, world, overrides):
    """(logits, {module path: class name}) of the rank's model built from the composed config."""
    from mptrain.groups import build_groups
    from mptrain.layers.gpt import build_model_chunks

    cfg = as_config(compose(SMALL + overrides))
    g = build_groups(1, 1)
    try:
        (chunk,) = build_model_chunks(cfg.model, cfg.parallel, g, vocab_size=64, seed=3)
        with torch.no_grad():  # biases start at zero: a bias the model dropped would not show
            for name, p in chunk.named_parameters():
                if name.endswith("bias"):
                    p.copy_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))
        ids = torch.arange(32).remainder(64).view(2, 16)
        with torch.no_grad():
            logits = chunk(ids)
        names = {n: type(m).__name__ for n, m in chunk.named_modules()}
        return logits, names, sorted(dict(chunk.named_parameters())), getattr(chunk, "tag", None)
    finally:
        g.destroy()


_BUILT: dict = {}


def _outputs_once(overrides: list) -> tuple:
    """`_outputs` on one process, computed once per overrides in this module (suite time: the built-in model is every
    user class's reference)."""
    key = tuple(overrides)
    if key not in _BUILT:
        _BUILT[key] = run_distributed(_outputs, 1, list(overrides))[0]
    return _BUILT[key]


@pytest.mark.parametrize("overrides, module, cls", [
    (["model._target_=test_model_components.MyGPT", "+model.tag=mine"], "", "MyGPT"),
    (["model.transformer_layer._target_=test_model_components.MyLayer"], "decoder.layers.1", "MyLayer"),
    ([f"{SUBS}.self_attention.submodules.linear_qkv._target_=test_model_components.MyColumn",
      f"{SUBS}.mlp.submodules.linear_fc1._target_=test_model_components.MyColumn"],
     "decoder.layers.0.mlp.linear_fc1", "MyColumn"),
    ([f"{SUBS}.self_attention.submodules.linear_proj._target_=test_model_components.MyRow",
      f"{SUBS}.mlp.submodules.linear_fc2._target_=test_model_components.MyRow"],
     "decoder.layers.1.self_attention.linear_proj", "MyRow"),
    ([f"{SUBS}.mlp.submodules.activation._target_=torch.nn.GELU"], "decoder.layers.0.mlp.act", "GELU"),
    ([f"{SUBS}.mlp.submodules.activation._target_=test_model_components.MyGELU"], "decoder.layers.0.mlp.act",
     "MyGELU"),
    ([f"{SUBS}.mlp.submodules.linear_fc1._target_=test_model_components.MySkipBiasColumn",
      f"{SUBS}.mlp.submodules.linear_fc2._target_=test_model_components.MySkipBiasRow",
      f"{SUBS}.self_attention.submodules.linear_qkv._target_=test_model_components.MySkipBiasColumn",
      f"{SUBS}.self_attention.submodules.linear_proj._target_=test_model_components.MySkipBiasRow"],
     "decoder.layers.0.mlp.linear_fc2", "MySkipBiasRow"),
    ([f"{CORE}._target_=mptrain_plugins.attention.SlidingWindowAttention"],
     "decoder.layers.0.self_attention.core_attention", "SlidingWindowAttention"),
])
def test_user_class_in_the_tree_equals_the_builtin(overrides, module, cls):
    (ref, ref_names, ref_params, _), (out, names, params, tag) = (
        _outputs_once([]), _outputs_once(overrides))
    assert names[module] == cls and ref_names[module] != cls  # the user's class was built there
    assert params == ref_params  # parameter names (checkpoints, export) unchanged
    if overrides[-1] == "+model.tag=mine":
        assert tag == "mine"  # the provider's own keyword reached it
    # subclasses / torch.nn.GELU: the same ops -> bitwise; the explicit softmax core: fp32 rounding
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_user_norm_target_equals_the_normalization_key():
    rms = [f"{SUBS}.input_layernorm._target_=mptrain.layers.norms.RMSNorm",
           f"{SUBS}.pre_mlp_layernorm._target_=mptrain.layers.norms.RMSNorm"]
    (a, names, _, _), (b, _, _, _) = (run_distributed(_outputs, 1, rms)[0],
                                      run_distributed(_outputs, 1, ["model.normalization=RMSNorm"])[0])
    assert names["decoder.final_layernorm"] == "RMSNorm"  # the final norm follows input_layernorm's node
    assert torch.equal(a, b)


def test_sliding_window_changes_the_output():
    full = _outputs_once([f"{CORE}._target_=mptrain_plugins.attention.SlidingWindowAttention"])[0]
    windowed = run_distributed(_outputs, 1, [f"{CORE}._target_=mptrain_plugins.attention.SlidingWindowAttention",
                                             f"+{CORE}.window=4"])[0][0]
    assert torch.equal(full[:, :4], windowed[:, :4])  # the first 4 positions see the same keys
    assert not torch.allclose(full[:, 4:], windowed[:, 4:])


def test_user_core_attention_trains_like_builtin_at_tp2_sp(tmp_path):
    base = ["model=tiny", "train.train_iters=3", "train.eval_interval=null", "parallel=tp2pp1",
            "parallel.sequence_parallel=true"]
    run_distributed(run_job, 2, base + [f"run.dir={tmp_path / 'builtin'}"])
    run_distributed(run_job, 2, base + [f"{CORE}._target_=mptrain_plugins.attention.SlidingWindowAttention",
                                        f"run.dir={tmp_path / 'user'}"])
    saved = OmegaConf.load(tmp_path / "user" / "config.yaml")
    assert OmegaConf.select(saved, CORE + "._target_") == "mptrain_plugins.attention.SlidingWindowAttention"
    a, b = read_rows(tmp_path / "builtin"), read_rows(tmp_path / "user")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):  # fp32, same math, different kernels: DESIGN.md §3 tolerances
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_qk_layernorm_trains_alike_at_tp2_and_tp1(tmp_path):
    """model.qk_layernorm: a query and a key norm [hn] per layer; at tp2 without sequence parallelism each TP rank
    normalises its own heads, so the replicated weights' grads are summed over TP: tp2 equals tp1 per step."""
    base = ["model=tiny", "model.qk_layernorm=true", "model.normalization=RMSNorm", "model.position_embedding_type=rope",
            "train.train_iters=3", "train.eval_interval=null"]
    run_distributed(run_job, 1, base + ["parallel=tp1pp1", f"run.dir={tmp_path / 'tp1'}"])
    run_distributed(run_job, 2, base + ["parallel=tp2pp1", f"run.dir={tmp_path / 'tp2'}"])
    a, b = read_rows(tmp_path / "tp1"), read_rows(tmp_path / "tp2")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):  # fp32, same math, other reduction order: DESIGN.md §3 tolerances
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    _, names, params, _ = run_distributed(_outputs, 1, ["model.qk_layernorm=true"])[0]
    assert names["decoder.layers.0.self_attention.q_layernorm"] == "LayerNorm"  # model.normalization's class
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in params


@pytest.mark.parametrize("overrides, expected", [
    ([f"{CORE}._target_=mptrain_plugins.no_such_module.Core"], f"{CORE}._target_=mptrain_plugins.no_such_module.Core"),
    ([f"{CORE}._target_=collections.OrderedDict"], f"{CORE}._target_=collections.OrderedDict is not a valid core attention: it lacks forward"),
    ([f"+{CORE}.windw=4"], f"{CORE}.windw: mptrain.layers.attention.DotProductAttention takes no keyword 'windw'"),
    ([f"{CORE}._target_=mptrain_plugins.attention.SlidingWindowAttention", f"+{CORE}.windw=4"],
     f"{CORE}.windw: mptrain_plugins.attention.SlidingWindowAttention takes no keyword 'windw'; it accepts: window"),
    ([f"{SUBS}.mlp.submodules.linear_fc1._target_=mptrain.layers.nope.Linear"], f"{SUBS}.mlp.submodules.linear_fc1._target_"),
    (["model._target_=mptrain.layers.gpt.pipeline_layer_ranges", "+model.foo=1"], "model.foo: mptrain.layers.gpt.pipeline_layer_ranges takes no keyword 'foo'"),
    (["model.normalization=BatchNorm"], "model.normalization: unknown option 'BatchNorm'; valid: LayerNorm, RMSNorm"),
    (["model.attention_backend=flash"], "model.attention_backend: unknown option 'flash'; valid: auto, sdpa, unfused"),
    (["model=moe_tiny", f"{SUBS}.moe.submodules.router._target_=mptrain.layers.nope.Router"],
     f"{SUBS}.moe.submodules.router._target_"),
    (["model=moe_tiny", f"{SUBS}.moe.submodules.experts._target_=collections.OrderedDict"],
     f"{SUBS}.moe.submodules.experts._target_=collections.OrderedDict is not a valid MoE experts: it lacks forward"),
])
def test_bad_target_is_one_config_error_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(compose(overrides), 1)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_dense_model_does_not_build_or_check_the_moe_node():
    validate_config(compose([f"{SUBS}.moe.submodules.router._target_=mptrain.layers.nope.Router"]), 1)


def test_cfg_job_shows_the_spec_tree_targets():
    text = OmegaConf.to_yaml(compose([]))
    for target in ("mptrain.layers.gpt.GPTModel", "mptrain.layers.transformer.TransformerLayer",
                   "mptrain.layers.norms.Norm", "mptrain.layers.attention.SelfAttention",
                   "mptrain.layers.linear.ColumnParallelLinear", "mptrain.layers.attention.DotProductAttention",
                   "mptrain.layers.linear.RowParallelLinear", "mptrain.layers.mlp.MLP", "mptrain.layers.mlp.Activation"):
        assert f"_target_: {target}" in text


def test_train_py_exits_1_with_one_line_for_a_bad_core(tmp_path):
    import os
    from pathlib import Path

    from procs import run_python

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "examples" / "plugins")])}
    proc = run_python([str(root / "train.py"), f"{CORE}._target_=mptrain_plugins.attention.NoSuchCore",
                       f"run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{CORE}._target_=mptrain_plugins.attention.NoSuchCore" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written before validation passed


def test_wrong_typed_keyword_of_a_spec_node_is_one_config_error(tmp_path):
    """`+...core_attention.window=abc` reaches the user's constructor, which raises TypeError: one ConfigError
    naming the node and the given key (not a traceback), and the corrected start reuses the folder."""
    from train_utils import compose

    from mptrain.errors import ConfigError
    from mptrain.training.run import run

    core = "model.transformer_layer.submodules.self_attention.submodules.core_attention"
    base = ["model=tiny", "train.train_iters=1", "train.eval_interval=null", f"run.dir={tmp_path}/r",
            f"{core}._target_=mptrain_plugins.attention.SlidingWindowAttention"]
    with pytest.raises(ConfigError, match=rf"^{core}: mptrain_plugins.attention.SlidingWindowAttention rejected its "
                                          rf"arguments \(TypeError: .*\(given: {core}.window='abc'\)$"):
        run(compose(base + [f"+{core}.window=abc"]))
    run(compose(base + [f"+{core}.window=16"]))


def _recompute_flags(rank, world, overrides):
    """(attention cores recomputed, full-layer recompute) of the rank's model built from the composed config."""
    from mptrain.groups import build_groups
    from mptrain.layers.gpt import build_model_chunks

    cfg = as_config(compose(SMALL + overrides))
    g = build_groups(1, 1)
    try:
        (chunk,) = build_model_chunks(cfg.model, cfg.parallel, g, vocab_size=64, seed=3)
        cores = [m.recompute_core for n, m in chunk.named_modules() if n.endswith("self_attention")]
        return cores, chunk.decoder.recompute
    finally:
        g.destroy()


@pytest.mark.parametrize("overrides, expected", [
    ([], ([False, False], False)),
    (["model.recompute_activations=true"], ([True, True], False)),  # Megatron's shorthand for selective
    (["model.recompute_granularity=selective"], ([True, True], False)),
    (["model.recompute_activations=true", "model.recompute_granularity=selective"], ([True, True], False)),
])
def test_recompute_activations_is_selective_recompute(overrides, expected):
    assert run_distributed(_recompute_flags, 1, overrides)[0] == expected


def test_recompute_activations_with_full_granularity_is_one_config_error():
    with pytest.raises(ConfigError) as err:
        validate_config(compose(["model=tiny", "model.recompute_activations=true", "model.recompute_granularity=full",
                                 "model.recompute_method=uniform", "model.recompute_num_layers=1"]), 1)
    assert str(err.value) == ("model.recompute_activations=true means recompute_granularity=selective, but "
                              "model.recompute_granularity=full; set model.recompute_activations=false or "
                              "model.recompute_granularity=null")


def _ln_context():
    import types

    return types.SimpleNamespace(params_dtype=torch.float32, device=torch.device("cpu"), sequence_parallel=False)


def test_layernorm_1p_is_layernorm_with_weight_one_plus_w():
    """model.apply_layernorm_1p (Megatron's zero-centred gamma): w starts at zeros and the forward is a LayerNorm whose
    weight is 1 + w, at init and after w moved."""
    from mptrain.config.model import ModelConfig
    from mptrain.layers.norms import LayerNorm1P, Norm

    norm = Norm(8, config=ModelConfig(apply_layernorm_1p=True), eps=1e-5, context=_ln_context())
    assert isinstance(norm, LayerNorm1P) and torch.equal(norm.weight, torch.zeros(8))
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.LayerNorm(8, eps=1e-5)
    torch.testing.assert_close(norm(x), ref(x), rtol=0, atol=0)  # at init: 1 + 0 = 1, the same op
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        norm.bias.copy_(torch.linspace(0.1, 0.8, 8))
        ref.weight.copy_(1 + norm.weight)
        ref.bias.copy_(norm.bias)
    torch.testing.assert_close(norm(x), ref(x), rtol=0, atol=0)
    assert not torch.allclose(norm(x), torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias, 1e-5))


def test_rmsnorm_1p_is_rmsnorm_with_weight_one_plus_w():
    """model.apply_layernorm_1p with RMSNorm (Transformer Engine's zero_centered_gamma, as Megatron's Llama recipes
    use it): w starts at zeros and the forward is an RMSNorm whose weight is 1 + w."""
    from mptrain.config.model import ModelConfig
    from mptrain.layers.norms import Norm, RMSNorm1P

    norm = Norm(8, config=ModelConfig(apply_layernorm_1p=True, normalization="RMSNorm"), eps=1e-5, context=_ln_context())
    assert isinstance(norm, RMSNorm1P) and torch.equal(norm.weight, torch.zeros(8))
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.RMSNorm(8, eps=1e-5)
    torch.testing.assert_close(norm(x), ref(x), rtol=0, atol=0)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        ref.weight.copy_(1 + norm.weight)
    torch.testing.assert_close(norm(x), ref(x), rtol=0, atol=0)
    assert not torch.allclose(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-5))


def test_layernorm_1p_model_starts_with_zero_norm_weights_and_rejects_apex_norms():
    with pytest.raises(ConfigError) as err:
        validate_config(compose(["model=tiny", "model.apply_layernorm_1p=true", "model.normalization=ApexFusedRMSNorm"]), 1)
    assert str(err.value) == ("model.apply_layernorm_1p=true (zero-centred gamma) has no ApexFusedRMSNorm form; set "
                              "model.normalization to one of LayerNorm, RMSNorm or model.apply_layernorm_1p=false")
    _, names, _, _ = run_distributed(_outputs, 1, ["model.apply_layernorm_1p=true"])[0]
    assert names["decoder.layers.0.input_layernorm"] == "LayerNorm1P" and names["decoder.final_layernorm"] == "LayerNorm1P"


def _partial_rope_reference(x, percent, base=10000.0):
    """Megatron's partial RoPE written out per dim pair: the first rot = int(hn × percent) dims, frequencies
    base^(-2i/rot), pairs (i, i + rot/2) rotated by position × frequency; the other dims unchanged."""
    s, _, _, hn = x.shape
    rot = int(hn * percent)
    out = x.clone()
    for pos in range(s):
        for i in range(rot // 2):
            angle = pos * base ** (-2 * i / rot)
            a, b = x[pos, ..., i], x[pos, ..., i + rot // 2]
            out[pos, ..., i] = a * math.cos(angle) - b * math.sin(angle)
            out[pos, ..., i + rot // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


@pytest.mark.parametrize("percent", [0.5, 0.25, 1.0])
def test_rotary_percent_rotates_the_first_dims_only(percent):
    from mptrain.layers.attention import apply_rope, rope_cos_sin, rotary_dim

    x = torch.randn(6, 2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).float()
    rot = rotary_dim(16, percent)
    cos, sin = rope_cos_sin(6, rot, 10000.0, torch.device("cpu"))
    got = apply_rope(x, cos, sin)
    torch.testing.assert_close(got, _partial_rope_reference(x.double(), percent).float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., rot:], x[..., rot:])  # passed through untouched
    if percent < 1.0:
        assert not torch.allclose(got[1:, ..., :rot], x[1:, ..., :rot])  # positions > 0 rotate


def test_rotary_percent_in_the_model_and_its_errors():
    rope = ["model.position_embedding_type=rope"]
    full, _, _, _ = run_distributed(_outputs, 1, rope)[0]
    half, _, _, _ = run_distributed(_outputs, 1, rope + ["model.rotary_percent=0.5"])[0]
    assert not torch.allclose(full, half)  # the same weights, another rotation: the logits differ
    for overrides, message in (
            (["model.rotary_percent=0.5"], "model.rotary_percent=0.5 applies to RoPE only, but "
                                           "model.position_embedding_type=learned_absolute"),
            (rope + ["model.rotary_percent=0"], "model.rotary_percent=0.0 must be in (0, 1]"),
            (rope + ["model.rotary_percent=0.1"], "model.rotary_percent=0.1 rotates int(0.1 × head dim 16) = 1 dims")):
        with pytest.raises(ConfigError) as err:
            validate_config(compose(["model=tiny", *overrides]), 1)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
