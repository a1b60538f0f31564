"""Optimizer builders (by _target_, param groups, kernels) and the LR schedule (values per style, state_dict)."""

import math
import types

import pytest
import torch

from mptrain.config.optim import OptimConfig
from mptrain.errors import ConfigError
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import OptimizerParamScheduler, build_optimizer_factory, param_groups

# lr 1.0, min_lr 0.1, warmup 2, decay reaches min_lr at step 6. Entry n = LR after n scheduler steps,
# i.e. the LR of iteration n + 1 (iteration 1 runs at 0 during warmup, as Megatron).
COS_3 = 0.1 + 0.9 * (1 + math.cos(math.pi * 0.25)) / 2  # 0.8681980515...
COS_5 = 0.1 + 0.9 * (1 + math.cos(math.pi * 0.75)) / 2  # 0.2318019484...
LR_TABLE = {
    "constant": [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "linear": [0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1],
    "cosine": [0.0, 0.5, 1.0, COS_3, 0.55, COS_5, 0.1, 0.1, 0.1],
}


def _opt(lr=0.123):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(3))]}]
    return torch.optim.SGD(groups, lr=lr)


@pytest.mark.parametrize("style", list(LR_TABLE))
def test_lr_schedule_values(style):
    opt = _opt()
    sched = OptimizerParamScheduler(opt, lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=6, lr_decay_style=style)
    got = [opt.param_groups[0]["lr"]]
    for _ in range(8):
        sched.step()
        got.append(opt.param_groups[0]["lr"])
        assert opt.param_groups[1]["lr"] == got[-1]  # every group gets the LR
    # 1e-12: the formulas are evaluated in float64 in the same order as the table; only rounding differs
    assert got == pytest.approx(LR_TABLE[style], rel=1e-12, abs=1e-12)
    assert sched.get_lr() == got[-1]


def test_lr_schedule_without_warmup_and_decay_is_constant():
    opt = _opt()
    sched = OptimizerParamScheduler(opt, lr=3e-4, min_lr=0.0, lr_warmup_iters=0, lr_decay_iters=None, lr_decay_style="constant")
    assert [opt.param_groups[0]["lr"]] + [sched.step() for _ in range(5)] == [3e-4] * 6


def test_lr_schedule_increment_and_state_dict_round_trip():
    opt = _opt()
    kwargs = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=6, lr_decay_style="cosine")
    sched = OptimizerParamScheduler(opt, **kwargs)
    assert sched.step(increment=3) == pytest.approx(COS_3, rel=1e-12)  # same formula, rounding only
    saved = sched.state_dict()
    assert saved["num_steps"] == 3
    opt2 = _opt()
    resumed = OptimizerParamScheduler(opt2, **kwargs)
    assert opt2.param_groups[0]["lr"] == 0.0
    resumed.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for _ in range(4):
        assert resumed.step() == sched.step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr_decay_style="cosine", lr_decay_iters=None), "lr_decay_style=cosine needs optim.lr_decay_iters"),
        (dict(lr_decay_style="linear", lr_decay_iters=2), "lr_decay_iters=2 must be > lr_warmup_iters=2"),
        (dict(lr_decay_style="step"), "unknown optim.lr_decay_style='step'; pick one of constant, linear, cosine"),
        (dict(min_lr=2.0), "min_lr=2.0 must be <= lr=1.0"),
        (dict(lr_warmup_iters=-1), "must be >= 0"),
    ],
)
def test_lr_schedule_rejects(kwargs, match):
    base = dict(lr=1.0, min_lr=0.0, lr_warmup_iters=2, lr_decay_iters=10, lr_decay_style="constant")
    with pytest.raises(ConfigError, match=match):
        OptimizerParamScheduler(_opt(), **{**base, **kwargs})


class Recorder:
    """A user optimizer (by dotted path) that records the keywords it was built with; takes fused and foreach
    as torch's Adam does."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=None, foreach=None):
        self.param_groups = list(params)
        self.kwargs = {k: v for k, v in dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused,
                                               foreach=foreach).items() if v is not None}

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none=True): ...

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict): ...


def _params_and_specs():
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(4))
    ln = torch.nn.Parameter(torch.ones(3))
    specs = [ShardSpec((4, 3)), ShardSpec((4,), no_weight_decay=True), ShardSpec((3,), no_weight_decay=True)]
    return [w, b, ln], specs


def test_param_groups_split_by_no_weight_decay():
    params, specs = _params_and_specs()
    groups = param_groups(params, specs)
    assert [len(g["params"]) for g in groups] == [1, 2]
    assert groups[0]["params"][0] is params[0] and "weight_decay" not in groups[0]
    assert groups[1]["weight_decay"] == 0.0
    assert param_groups(params, specs, 0.1)[0]["weight_decay"] == 0.1
    with pytest.raises(ValueError, match="3 params but 2 specs"):
        param_groups(params, specs[:2])


@pytest.mark.parametrize("name, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)])
def test_factory_builds_each_optimizer_with_fused_kernels_on_cpu(name, cls):
    params, specs = _params_and_specs()
    cfg = OptimConfig(_target_=f"torch.optim.{cls.__name__}", lr=0.5, weight_decay=0.01, sgd_momentum=0.9)
    opt = build_optimizer_factory(cfg)(param_groups(params, specs))
    assert type(opt) is cls
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]  # CPU params: the fused kernels, as on CUDA
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(g["lr"] == 0.5 for g in opt.param_groups)
    if name != "sgd":
        assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-8
    else:
        assert opt.defaults["momentum"] == 0.9


def test_factory_matches_a_plain_torch_optimizer():
    torch.manual_seed(0)
    params, specs = _params_and_specs()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    cfg = OptimConfig(_target_="torch.optim.AdamW", lr=0.1, weight_decay=0.1)
    ours = build_optimizer_factory(cfg)(param_groups(params, specs))
    theirs = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": ref[1:], "weight_decay": 0.0}],
                               lr=0.1, foreach=False)
    for _ in range(3):
        for p, r in zip(params, ref):
            g = torch.randn_like(p)
            p.grad, r.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, r in zip(params, ref):
        # fused vs for-loop kernels: same math, different op order; 1e-6 covers a few fp32 ulps
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"_target_": "torch.optim.Lion"}, r"^optim._target_=torch.optim.Lion: module torch.optim has no Lion; fix the "
                                           r"dotted path"),
        ({"_target_": "torch.optim.RMSprop", "impl": "apex"}, r"^optim.impl=apex: apex has fused kernels only for "
         r"torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, not optim._target_=torch.optim.RMSprop"),
        ({"impl": "cuda"}, "unknown optim.impl='cuda'; pick one of auto, torch, apex"),
        ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr"),
    ],
)
def test_factory_rejects(override, match):
    with pytest.raises(ConfigError, match=match):
        build_optimizer_factory(OptimConfig(**override))


def test_the_label_does_not_select():
    """``optim.name`` is a label: `_target_` alone decides what is built (no name -> class table)."""
    opt = build_optimizer_factory(OptimConfig(name="sgd", lr=0.5))(param_groups(*_params_and_specs()))
    assert type(opt) is torch.optim.Adam and opt.defaults["betas"] == (0.9, 0.999)  # the schema's default target
    opt = build_optimizer_factory(OptimConfig(_target_="torch.optim.SGD", name="adam", lr=0.5, sgd_momentum=0.9))(
        param_groups(*_params_and_specs()))
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9


def test_optimizer_kernel_names_class_and_kernel():
    from mptrain.optim import optimizer_kernel

    groups = param_groups(*_params_and_specs())
    assert optimizer_kernel(build_optimizer_factory(OptimConfig(_target_="torch.optim.AdamW"))(groups)) == \
        "torch.optim.AdamW (fused=True)"
    assert optimizer_kernel(torch.optim.SGD(groups, lr=0.1, foreach=True)) == "torch.optim.SGD (foreach=True)"
    assert optimizer_kernel(torch.optim.SGD(groups, lr=0.1, foreach=False)) == "torch.optim.SGD (for-loop)"
    assert optimizer_kernel(Recorder(groups)) == "test_optim.Recorder"


def test_apex_requested_but_missing_is_a_config_error():
    try:
        import apex.optimizers  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="optim.impl=apex but apex.optimizers is not importable"):
            build_optimizer_factory(OptimConfig(impl="apex"))
    else:  # pragma: no cover - apex present (GPU machine)
        opt = build_optimizer_factory(OptimConfig(impl="apex"))(param_groups(*_params_and_specs()))
        assert type(opt).__name__ == "FusedAdam"


@pytest.mark.parametrize("devices, kernel", [(("cuda", "cuda"), "fused"), (("cpu",), "fused"), (("cpu", "cuda"), "foreach"),
                                             (("meta",), "foreach")])
def test_factory_picks_the_kernel_by_device(devices, kernel):
    params = [types.SimpleNamespace(device=torch.device(d)) for d in devices]
    opt = build_optimizer_factory(OptimConfig(_target_="test_optim.Recorder"))([{"params": params}])
    assert opt.kwargs == {**opt.kwargs, kernel: True} and len({"fused", "foreach"} & set(opt.kwargs)) == 1


def test_hydra_composes_every_optim_option():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from mptrain.config import schema

    schema.register()
    GlobalHydra.instance().clear()
    conf_dir = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "conf")
    built = {}
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        for name in ("adam", "adamw", "sgd"):
            cfg = OmegaConf.to_object(compose("config", overrides=[f"optim={name}"]).optim)
            opt = build_optimizer_factory(cfg)(param_groups(*_params_and_specs()))
            built[name] = (type(opt).__name__, cfg.lr, [g["weight_decay"] for g in opt.param_groups])
            OptimizerParamScheduler(opt, lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_iters=cfg.lr_warmup_iters,
                                    lr_decay_iters=cfg.lr_decay_iters, lr_decay_style=cfg.lr_decay_style)
    GlobalHydra.instance().clear()
    assert built == {"adam": ("Adam", 1e-3, [0.0, 0.0]), "adamw": ("AdamW", 1e-3, [0.01, 0.0]),
                     "sgd": ("SGD", 0.01, [0.0, 0.0])}
