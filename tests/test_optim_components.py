"""Optimizer, LR schedule, loss scaler and optimizer wrapper as `_target_` components.

A user's class in each kind, from CLI-style overrides: torch.optim.RMSprop (+ its own keyword) trains
and resumes bitwise (tp1pp1 and tp2pp2 on the gloo test pool), the example LR schedule sets the
expected `lr` values, a user scaler / wrapper subclass equals the built-in, and every bad plug-in is
one ConfigError line naming the key. Also: python `random` / NumPy seeded from train.seed.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from harness import run_distributed
from mptrain.training.validate import validate_config
from mptrain.errors import ConfigError
from mptrain.precision.optimizer import MixedPrecisionOptimizer, ParamState, StepResult, StepStats, WrapperState
from mptrain.precision.scaler import ConstantLossScaler
from train_utils import compose, read_rows, run_job

SMALL = ["model=tiny", "model.num_layers=4", "model.hidden_size=32", "model.seq_length=16", "train.eval_interval=null",
         "train.global_batch_size=8", "train.micro_batch_size=2"]
RMSPROP = ["optim._target_=torch.optim.RMSprop", "+optim.alpha=0.9"]
KEYS = ("lm_loss", "grad_norm", "loss_scale", "lr")


# --- user classes (module level: the pool workers import them by dotted path) -------------------------
class ScaledConstant(ConstantLossScaler):
    """A user scaler with its own keyword: scale = base * multiplier."""

    def __init__(self, base: float, multiplier: float = 1.0) -> None:
        super().__init__(base * multiplier)


class CountingWrapper(MixedPrecisionOptimizer):
    """A user wrapper: the built-in mixed-precision one, counting its steps."""

    def step(self, grad_scale=None):
        self.steps_taken = getattr(self, "steps_taken", 0) + 1
        return super().step(grad_scale)


class PlainFP32Wrapper:
    """A user optimizer wrapper written against the declared interface only (no mptrain base class):
    the run's inner optimizer over the fp32 model params, stepped in place; no loss scaler, no clipping;
    a step with a non-finite grad norm is skipped. ``steps_taken`` counts its steps in this process."""

    steps_taken = 0

    def __init__(self, build_optimizer, params: list, grad_fn) -> None:
        self.params, self.grad_fn = list(params), grad_fn
        self.optimizer = build_optimizer([{"params": self.params}])
        self.skipped = 0

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def get_loss_scale(self) -> float:
        return 1.0

    @torch.no_grad()
    def step(self, grad_scale=None) -> StepStats:
        PlainFP32Wrapper.steps_taken += 1
        for p in self.params:
            grad = self.grad_fn(p)
            p.grad = grad.clone() if grad_scale is None else grad * grad_scale.to(grad.dtype)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params]))
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            self.optimizer.step()
        values = torch.stack([norm.double(), torch.tensor(float(skipped), dtype=torch.float64),
                              torch.tensor(math.nan, dtype=torch.float64)])
        return StepStats(values, self._settle)

    def _settle(self, values: list) -> StepResult:
        norm, skipped, _ = values
        self.skipped += int(skipped)
        return StepResult(update_successful=not skipped, grad_norm=None if skipped else norm, num_zeros=None,
                          found_inf=bool(skipped), skipped_iters_total=self.skipped, nan_iters_total=self.skipped)

    def sharded_state_dict(self) -> WrapperState:
        return WrapperState(params=[ParamState(p, None, dict(self.optimizer.state.get(p, {}))) for p in self.params],
                            counters={"skipped_iters_total": self.skipped, "nan_iters_total": self.skipped,
                                      "consecutive_skips": 0})

    def load_sharded_state_dict(self, state: WrapperState) -> None:
        if state.params is not None:
            saved = self.optimizer.state_dict()
            saved["state"] = {i: dict(piece.state) for i, piece in enumerate(state.params) if piece.state}
            self.optimizer.load_state_dict(saved)
        if state.counters is not None:
            self.skipped = int(state.counters.get("skipped_iters_total", 0))


def _count_wrapper_steps(rank, world, overrides) -> int:
    PlainFP32Wrapper.steps_taken = 0
    run_job(rank, world, overrides)
    return PlainFP32Wrapper.steps_taken


class DrawingRMSprop(torch.optim.RMSprop):
    """Draws from python `random` and NumPy when built (what an unseeded user component would break)."""

    drawn: list = []

    def __init__(self, params, lr: float = 0.01, alpha: float = 0.99, eps: float = 1e-8, foreach=None) -> None:
        DrawingRMSprop.drawn.append((random.random(), float(np.random.random())))
        super().__init__(params, lr=lr, alpha=alpha, eps=eps, foreach=foreach)


def _draws_task(rank, world, overrides):
    run_job(rank, world, overrides)
    return DrawingRMSprop.drawn[-1]  # the last build is the training one (validate_config builds a throwaway first)


def _rows(run_dir) -> dict:
    return {r["iteration"]: r for r in read_rows(run_dir)}


def _pick(rows: dict, iterations) -> list:
    return [{k: rows[i][k] for k in KEYS} for i in iterations]


# --- config ------------------------------------------------------------------------------------------
def test_cfg_job_shows_targets_and_the_schema_defaults_are_the_default_options():
    from omegaconf import OmegaConf

    from mptrain.config.optim import OptimConfig
    from mptrain.config.precision import LossScalerConfig

    text = OmegaConf.to_yaml(compose(["precision=bf16"]))
    for target in ("torch.optim.Adam", "mptrain.optim.lr_scheduler.OptimizerParamScheduler",
                   "mptrain.precision.optimizer.MixedPrecisionOptimizer", "mptrain.precision.scaler.auto_loss_scaler"):
        assert f"_target_: {target}" in text
    assert {name: compose([f"optim={name}"]).optim._target_ for name in ("adam", "adamw", "sgd")} == {
        "adam": "torch.optim.Adam", "adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}
    # a Python-made config (no YAML) builds what the default options build: the schemas carry their targets
    default = compose([])
    assert (OptimConfig()._target_, OptimConfig().name) == (default.optim._target_, default.optim.name)
    assert (LossScalerConfig()._target_, LossScalerConfig().name) == (default.loss_scaler._target_,
                                                                      default.loss_scaler.name)


def test_rmsprop_from_overrides_is_built_with_mapped_and_own_keywords():
    from mptrain.config.schema import as_config
    from mptrain.optim import build_optimizer_factory

    cfg = as_config(compose(RMSPROP + ["optim.lr=0.01", "optim.weight_decay=0.1"]))
    p = torch.nn.Parameter(torch.zeros(3))
    opt = build_optimizer_factory(cfg.optim)([{"params": [p]}])
    assert type(opt) is torch.optim.RMSprop
    d = opt.defaults
    assert (d["lr"], d["alpha"], d["weight_decay"], d["eps"], d["momentum"], d["foreach"]) == (0.01, 0.9, 0.1, 1e-8, 0.0, True)


BAD = [
    (["optim._target_=no_such_pkg.Opt"], "optim._target_=no_such_pkg.Opt does not import"),
    (["optim._target_=torch.nn.Linear"], "optim._target_=torch.nn.Linear is not a valid optimizer: it lacks step"),
    (["optim._target_=torch.optim"], r"^optim._target_=torch.optim is a module, not a class or function; name one in "
                                     r"it \(torch.optim.Name\)$"),
    (["optim._target_=math.pi"], r"^optim._target_=math.pi is not callable \(float\)"),
    (["optim.lr_scheduler._target_=torch.optim"], "^optim.lr_scheduler._target_=torch.optim is a module"),
    (["loss_scaler._target_=math"], r"^loss_scaler._target_=math is a module, not a class or function; name one in it "
                                    r"\(math.Name\)$"),
    (["+optim.foo=1"], "optim.foo: torch.optim.Adam takes no keyword 'foo'"),
    (RMSPROP[:1] + ["+optim.alpha=abc"], "optim: torch.optim.RMSprop rejected its arguments"),
    (["optim.lr=-1"], "optim.lr=-1.0 must be >= 0"),
    (["optim.min_lr=0.1", "optim.lr=0.01"], "optim.min_lr=0.1 must be <= optim.lr=0.01"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
    (["optim.adam_beta1=1.0"], r"optim.adam_beta1=1.0 must be in \[0, 1\)"),
    (["optim.adam_beta2=-0.5"], r"optim.adam_beta2=-0.5 must be in \[0, 1\)"),
    (["optim.adam_eps=0"], "optim.adam_eps=0.0 must be > 0"),
    (["optim.impl=cuda"], "unknown optim.impl='cuda'"),
    (["optim.lr_decay_style=step"], "unknown optim.lr_decay_style='step'"),
    (["optim.lr_scheduler._target_=no_such_pkg.Sched"], "optim.lr_scheduler._target_=no_such_pkg.Sched does not import"),
    (["optim.lr_scheduler._target_=torch.nn.Linear"], "optim.lr_scheduler._target_=torch.nn.Linear is not a valid LR schedule"),
    (["optim.lr_scheduler._target_=mptrain_plugins.lr_schedules.CosineWithRestarts"],
     "optim.lr_scheduler: mptrain_plugins.lr_schedules.CosineWithRestarts rejected its arguments .*cycle_iters"),
    (["+optim.lr_scheduler.cycle_iters=3"], "optim.lr_scheduler.cycle_iters: .*OptimizerParamScheduler takes no keyword"),
    (["loss_scaler._target_=no_such_pkg.S"], "loss_scaler._target_=no_such_pkg.S does not import"),
    (["loss_scaler._target_=torch.nn.Linear"], "loss_scaler._target_=torch.nn.Linear is not a valid loss scaler"),
    (["loss_scaler=constant", "+loss_scaler.foo=1"], "loss_scaler.foo: .*ConstantLossScaler takes no keyword 'foo'"),
    (["precision=fp16", "loss_scaler=none"], "loss_scaler: precision=fp16 with loss_scaler=none"),
    (["precision=fp16", "loss_scaler.initial_scale=-1"], "^loss_scaler: initial_scale=-1.0 must be > 0"),
    (["precision=fp16", "loss_scaler.max_consecutive_skips=-1"], "^loss_scaler.max_consecutive_skips=-1 must be >= 0"),
    (["precision._target_=no_such_pkg.W"], "precision._target_=no_such_pkg.W does not import"),
    (["precision._target_=torch.nn.Linear"], "precision._target_=torch.nn.Linear is not a valid optimizer wrapper"),
    # a key added to the precision node: checked at validation (before the run folder is written), the keys the
    # trainer passes refused, a misspelt schema key answered with it
    (["precision=bf16", "+precision.fp8_recipee=rowwise"],
     r"^precision.fp8_recipee: mptrain.precision.optimizer.MixedPrecisionOptimizer takes no keyword 'fp8_recipee'; "
     r"it accepts: fold_into_fused_step, log_num_zeros; did you mean precision.fp8_recipe\? remove the key "
     r"\(~precision.fp8_recipee where a preset sets it\) or fix its name$"),
    (["precision=bf16", "+precision.clip_grad=0.5"],
     r"^precision.clip_grad: the trainer passes 'clip_grad' to the optimizer wrapper itself \(train.clip_grad\); "
     r"remove the key$"),
    (["precision=bf16", "precision._target_=test_optim_components.CountingWrapper",
      "parallel.use_distributed_optimizer=true"], "precision._target_=test_optim_components.CountingWrapper is not a DistributedOptimizer"),
]


@pytest.mark.parametrize("overrides, match", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_plugins_are_one_config_error_line_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        validate_config(compose(overrides), 1)
    assert "\n" not in str(err.value)


def test_distributed_optimizer_replaces_the_builtin_wrappers_only():
    from mptrain.config.schema import as_config
    from mptrain.distributed import DistributedOptimizer
    from mptrain.distributed.distrib_optimizer import wrapper_target
    from mptrain.precision.optimizer import FP32Optimizer

    for precision, plain in (("fp32", FP32Optimizer), ("bf16", MixedPrecisionOptimizer), ("fp16", MixedPrecisionOptimizer)):
        node = as_config(compose([f"precision={precision}"])).precision
        assert wrapper_target(node, False) is plain
        assert wrapper_target(node, True) is DistributedOptimizer
    user = as_config(compose(["precision=bf16", "precision._target_=test_optim_components.CountingWrapper"])).precision
    assert wrapper_target(user, False) is CountingWrapper


# --- end to end (gloo pool, one process) -------------------------------------------------------------
def test_rmsprop_trains_and_resumes_bitwise(tmp_path):
    common = SMALL + RMSPROP + ["train.train_iters=6", "optim.lr=3e-3"]
    # the straight run saves after iteration 3 and goes on; the resume of that checkpoint trains 4 to 6 (a stop by
    # train.exit_interval and its resume: tests/test_checkpoint_resume.py)
    ckpt = tmp_path / "ckpt"
    run_distributed(run_job, 1, common + [f"run.dir={tmp_path / 'straight'}", f"checkpoint.save={ckpt}",
                                          "checkpoint.save_interval=3"])
    run_distributed(run_job, 1, common + [f"run.dir={tmp_path / 'resumed'}", f"checkpoint.load={ckpt}",
                                          "checkpoint.load_iteration=3"])
    want, got = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert sorted(got) == [4, 5, 6]
    assert _pick(got, range(4, 7)) == _pick(want, range(4, 7))  # bitwise: RMSprop's square_avg crossed the checkpoint
    assert want[6]["lm_loss"] < want[1]["lm_loss"]  # it trains


def test_user_wrapper_of_the_declared_interface_trains_and_resumes_bitwise(tmp_path):
    """8 straight iterations (saving after the 4th) == a resume of the checkpoint of iteration 4 to 8 (Adam's
    moments and step count saved from the wrapper's `sharded_state_dict`), with the user's wrapper taking every
    step."""
    common = SMALL + ["precision._target_=test_optim_components.PlainFP32Wrapper", "train.train_iters=8"]
    ckpt = tmp_path / "ckpt"
    assert run_distributed(_count_wrapper_steps, 1, common + [f"run.dir={tmp_path / 'straight'}", f"checkpoint.save={ckpt}",
                                                              "checkpoint.save_interval=4"]) == [8]
    assert run_distributed(_count_wrapper_steps, 1, common + [f"run.dir={tmp_path / 'resumed'}", f"checkpoint.load={ckpt}",
                                                              "checkpoint.load_iteration=4"]) == [4]
    want, got = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert sorted(got) == [5, 6, 7, 8]
    assert _pick(got, range(5, 9)) == _pick(want, range(5, 9))  # bitwise: the moments crossed the checkpoint
    assert want[8]["lm_loss"] < want[1]["lm_loss"]  # it trains


def test_user_lr_schedule_sets_the_expected_lr(tmp_path):
    run_distributed(run_job, 1, SMALL + [
        "train.train_iters=7", "optim.lr=0.01", "optim.min_lr=0.001", "optim.lr_warmup_iters=2",
        "optim.lr_scheduler._target_=mptrain_plugins.lr_schedules.CosineWithRestarts", "+optim.lr_scheduler.cycle_iters=3",
        f"run.dir={tmp_path}"])
    lrs = [r["lr"] for r in read_rows(tmp_path)]
    # iteration i runs at the LR after i - 1 steps: warmup 0, 0.005, 0.01, then restarts every 3 steps
    cos = [0.001 + (0.01 - 0.001) * 0.5 * (1 + math.cos(math.pi * t / 3)) for t in (0, 1, 2)]
    assert lrs == [0.0, 0.005, 0.01] + cos[1:] + cos[:2]


def test_user_scaler_and_wrapper_equal_the_builtins(tmp_path):
    common = SMALL + ["precision=fp16", "train.train_iters=3"]
    run_distributed(run_job, 1, common + ["loss_scaler=constant", "loss_scaler.scale=512", f"run.dir={tmp_path / 'a'}"])
    run_distributed(run_job, 1, common + [
        "loss_scaler._target_=test_optim_components.ScaledConstant", "+loss_scaler.base=128", "+loss_scaler.multiplier=4",
        "precision._target_=test_optim_components.CountingWrapper", f"run.dir={tmp_path / 'b'}"])
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert [r["loss_scale"] for r in b.values()] == [512.0] * 3
    assert _pick(b, range(1, 4)) == _pick(a, range(1, 4))


def test_fresh_run_seeds_python_and_numpy_from_train_seed(tmp_path):
    got = run_distributed(_draws_task, 1, SMALL + ["train.train_iters=1", "train.seed=77",
                                                   "optim._target_=test_optim_components.DrawingRMSprop",
                                                   f"run.dir={tmp_path}"])[0]
    random.seed(77)
    np.random.seed(77)  # Megatron's _set_random_seed: seed + 100 * pp_rank (pp_rank 0)
    assert tuple(got) == (random.random(), float(np.random.random()))


# --- end to end: tp2pp2 on 4 gloo ranks ----------------------------------------------------------------
def test_tp2pp2_rmsprop_resumes_bitwise(tmp_path):
    """Reference, first half and resume on the test pool's 4 ranks (the torchrun launch itself is covered by
    tests/test_torchrun.py; one launch fewer for the suite's time)."""
    common = SMALL + ["parallel=tp2pp2", "train.train_iters=4"] + RMSPROP
    # the straight run saves after iteration 2 and goes on; the resume of that checkpoint trains 3 and 4 (a stop by
    # train.exit_interval and its resume: tests/test_checkpoint_resume.py)
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed"
    run_distributed(run_job, 4, common + [f"run.dir={tmp_path / 'straight'}", f"checkpoint.save={ckpt}",
                                          "checkpoint.save_interval=2"])
    run_distributed(run_job, 4, common + [f"run.dir={resumed}", f"checkpoint.load={ckpt}", "checkpoint.load_iteration=2"])
    want, got = _rows(tmp_path / "straight"), _rows(resumed)
    assert sorted(got) == [3, 4]
    assert _pick(got, range(3, 5)) == _pick(want, range(3, 5))
