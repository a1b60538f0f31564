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
