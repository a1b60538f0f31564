"""Megatron's inverse-square-root and WSD LR styles: exact values against hand-written formulas."""

import math

import pytest
import torch

from mptrain.errors import ConfigError
from mptrain.optim import OptimizerParamScheduler


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)


def _lrs(n_steps: int, **kwargs) -> list:
    opt = _opt()
    sched = OptimizerParamScheduler(opt, **kwargs)
    return [opt.param_groups[0]["lr"]] + [sched.step() for _ in range(n_steps)]


def test_inverse_square_root():
    # lr 1, warmup 4, min_lr 0.3, no lr_decay_iters: lr * sqrt(4) / sqrt(n) after warmup, floored at 0.3
    got = _lrs(50, lr=1.0, min_lr=0.3, lr_warmup_iters=4, lr_decay_iters=None, lr_decay_style="inverse-square-root")
    assert got[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert got[9] == 1.0 * 4**0.5 / 9**0.5  # = 2/3, Megatron's expression
    assert (got[16], got[25]) == (0.5, 0.4)
    assert got[44] == 2 / 44**0.5 > 0.3
    assert got[45:] == [0.3] * 6  # 2 / sqrt(45) = 0.298 < min_lr: floored


def test_inverse_square_root_cut_at_decay_iters_and_without_warmup():
    got = _lrs(6, lr=1.0, min_lr=0.1, lr_warmup_iters=0, lr_decay_iters=4, lr_decay_style="inverse-square-root")
    # no warmup: max(W, 1) = 1 and max(n, 1): n = 0 and 1 give lr; after D = 4: min_lr
    assert got == [1.0, 1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5, 0.1, 0.1]


# WSD: lr 1, min_lr 0.1, warmup 2, decay ends at 10, the last 4 decay (anneal starts after step 6)
WSD = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10, lr_decay_style="WSD", lr_wsd_decay_iters=4)
WSD_COEFF = {
    "linear": lambda q: 1 - q,
    "cosine": lambda q: 0.5 * (1 + math.cos(math.pi * q)),
    "exponential": lambda q: 2 * 0.5**q - 1,
    "minus_sqrt": lambda q: 1 - math.sqrt(q),
}


@pytest.mark.parametrize("style", sorted(WSD_COEFF))
def test_wsd_values(style):
    got = _lrs(12, **WSD, lr_wsd_decay_style=style)
    want = [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]  # warmup, then stable through step 6
    want += [0.1 + 0.9 * WSD_COEFF[style]((n - 6) / 4) for n in (7, 8, 9, 10)]
    want += [0.1, 0.1]  # past lr_decay_iters
    assert got == want  # the same float expressions in the same order: bitwise
    assert got[10] == pytest.approx(0.1, abs=1e-15)  # every decay style ends at min_lr


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr_wsd_decay_iters=None), "lr_decay_style=WSD needs 1 <= optim.lr_wsd_decay_iters <= lr_decay_iters - lr_warmup_iters = 8"),
    (dict(lr_wsd_decay_iters=9), "got 9"),
    (dict(lr_wsd_decay_style="step"), "unknown optim.lr_wsd_decay_style='step'"),
    (dict(lr_decay_iters=None), "lr_decay_style=WSD needs optim.lr_decay_iters"),
])
def test_wsd_rejects(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OptimizerParamScheduler(_opt(), **{**WSD, **kwargs})


def test_wsd_state_dict_resume():
    opt, opt2 = _opt(), _opt()
    a = OptimizerParamScheduler(opt, **WSD)
    for _ in range(7):
        a.step()
    b = OptimizerParamScheduler(opt2, **WSD)
    b.load_state_dict(a.state_dict())
    assert [b.step() for _ in range(5)] == [a.step() for _ in range(5)]


# --- optim.lr_warmup_fraction (Megatron's --lr-warmup-fraction): W = fraction × the decay length ---------------
def test_warmup_fraction_of_the_decay_length():
    # lr 1, min_lr 0, D = 10, fraction 0.25: W = 2.5 iterations (not rounded: Megatron's lr * n / W)
    got = _lrs(12, lr=1.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_iters=10, lr_decay_style="linear",
               lr_warmup_fraction=0.25)
    want = [0.0, 1 / 2.5, 2 / 2.5] + [1.0 - (n - 2.5) / 7.5 for n in range(3, 11)] + [0.0, 0.0]
    assert got == pytest.approx(want, rel=0, abs=1e-15)
    assert got[2] == 0.8 and got[3] == pytest.approx(1 - 0.5 / 7.5)


def test_warmup_fraction_of_train_iters_when_no_decay_length():
    # lr_decay_iters null: Megatron's decay length defaults to train_iters = 20, W = 0.1 × 20 = 2
    got = _lrs(4, lr=1.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_iters=None, lr_decay_style="constant",
               lr_warmup_fraction=0.1, train_iters=20)
    assert got == [0.0, 0.5, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr_warmup_fraction=0.1", "optim.lr_warmup_iters=5"],
     "optim.lr_warmup_fraction=0.1 and optim.lr_warmup_iters=5 both set the warmup; set optim.lr_warmup_iters=0 or "
     "optim.lr_warmup_fraction=null"),
    (["optim.lr_warmup_fraction=1.5"], "optim.lr_warmup_fraction=1.5 must be in [0, 1]"),
    (["train.train_samples=32"], "train.train_iters=8 and train.train_samples=32 are both set; train by samples with "
                                 "train.train_iters=null, or set train.train_samples=null"),
    (["train.train_iters=null"], "train.train_iters=null needs train.train_samples=<samples>"),
    (["train.train_iters=null", "train.train_samples=32", "optim.lr_warmup_iters=2"],
     "optim.lr_warmup_iters=2 counts in iterations, but train.train_samples=32 counts the schedule in samples; set "
     "optim.lr_warmup_samples instead and optim.lr_warmup_iters=0"),
    (["optim.lr_decay_samples=32", "optim.lr_decay_style=linear"],
     "optim.lr_decay_samples=32 counts in samples, which needs sample-based training; set train.train_samples"),
    (["train.train_iters=null", "train.train_samples=32", "optim.lr_warmup_samples=8", "optim.lr_warmup_fraction=0.1"],
     "optim.lr_warmup_fraction=0.1 and optim.lr_warmup_samples=8 both set the warmup"),
])
def test_warmup_and_sample_keys_are_one_line_errors(overrides, message):
    from mptrain.training.validate import validate_config
    from train_utils import compose

    with pytest.raises(ConfigError) as err:
        validate_config(compose(["model=tiny", "train.train_iters=8", *overrides]), 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_run_config_with_the_derived_train_iters_validates():
    """config.yaml of a sample-based run records train_iters = train_samples // global_batch_size beside
    train_samples: read back, it validates (and one more iteration does not)."""
    from mptrain.training.validate import check_train_length
    from train_utils import compose

    cfg = compose(["model=tiny", "train.train_samples=36", "train.global_batch_size=8", "train.train_iters=4"])
    check_train_length(cfg.train)
    with pytest.raises(ConfigError, match="train.train_iters=5 and train.train_samples=36 are both set"):
        check_train_length(compose(["model=tiny", "train.train_samples=36", "train.global_batch_size=8",
                                    "train.train_iters=5"]).train)


# --- sample-based training (train.train_samples): the schedule counts samples, global_batch_size per step ----
SAMPLES = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=0, lr_decay_iters=None, lr_decay_style="cosine",
               lr_warmup_samples=8, lr_decay_samples=36, train_samples=40, global_batch_size=4)


def test_sample_based_schedule_values():
    got = _lrs(11, **SAMPLES)
    # n = 4 × steps samples; W = 8, D = 36: warmup to step 2, cosine to step 9, then min_lr
    want = [1.0 * 4 * k / 8 for k in range(3)]
    want += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (4 * k - 8) / 28)) for k in range(3, 10)]
    want += [0.1, 0.1]
    assert got == want
    assert got[:3] == [0.0, 0.5, 1.0] and got[9] == pytest.approx(0.1, abs=1e-15)
    # the same schedule in iterations (W = 2, D = 9): Megatron's samples are iterations × global_batch_size
    iters = _lrs(11, lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=9, lr_decay_style="cosine")
    assert got == pytest.approx(iters, rel=1e-14, abs=0)


def test_sample_based_warmup_fraction_of_the_decay_samples():
    # fraction 0.25 of D = 32 samples: W = 8 samples = 2 steps of 4
    got = _lrs(3, **{**SAMPLES, "lr_warmup_samples": 0, "lr_decay_samples": 32, "lr_warmup_fraction": 0.25})
    assert got[:3] == [0.0, 0.5, 1.0]


def test_sample_based_train_iters_and_resume_continue_the_same_lr(tmp_path):
    """train_samples=36 at global batch 4: 9 iterations; a run split at iteration 4 and resumed has the LR rows of the
    straight run, and those follow the sample-based schedule."""
    from harness import run_distributed
    from train_utils import read_rows, run_job

    common = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16",
              "train.eval_interval=null", "train.global_batch_size=4", "train.micro_batch_size=2",
              "train.train_iters=null", "train.train_samples=38", "optim.lr=1.0", "optim.min_lr=0.1",
              "optim.lr_decay_style=linear", "optim.lr_warmup_samples=8", "optim.lr_decay_samples=28"]
    straight, split, ckpt = tmp_path / "straight", tmp_path / "split", tmp_path / "ckpt"
    run_distributed(run_job, 1, common + [f"run.dir={straight}"])
    run_distributed(run_job, 1, common + [f"run.dir={split}", f"checkpoint.save={ckpt}", "train.exit_interval=4"])
    run_distributed(run_job, 1, common + [f"run.dir={split}", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}"])
    want, got = read_rows(straight), read_rows(split)
    assert [r["iteration"] for r in want] == list(range(1, 10))  # 38 // 4 = 9 iterations
    assert [r["consumed_samples"] for r in want] == [4 * i for i in range(1, 10)]
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
    # row i shows the LR iteration i ran at: after i - 1 steps, n = 4 (i - 1) samples; W = 8, D = 28
    expected = [4 * (i - 1) / 8 if 4 * (i - 1) <= 8 else
                (0.1 if 4 * (i - 1) > 28 else 0.1 + 0.9 * (1 - (4 * (i - 1) - 8) / 20)) for i in range(1, 10)]
    assert [r["lr"] for r in want] == pytest.approx(expected, rel=1e-6)
