"""``precision.flat_adam_step`` (`mptrain.precision.flat_adam`) on the CPU, where it runs eagerly when forced:
its layout (views at the grad buffer's offsets), its arithmetic against torch's fused Adam / AdamW through
`MixedPrecisionOptimizer` (clip, grad scale, a skipped step), its checkpoint state, and where it applies.
The compiled kernel against torch's CUDA kernel: tests/test_gpu_flat_adam.py; through the trainer with a
checkpoint resume: tests/test_checkpoint_resume.py (case bf16-flat-tp1pp2)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from mptrain.config.optim import OptimConfig
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import build_optimizer_factory
from mptrain.precision import ConstantLossScaler, MixedPrecisionOptimizer
from mptrain.precision.flat_adam import flat_adam_math

SOLO = types.SimpleNamespace(mp_group=None, tp_rank=0, device=torch.device("cpu"))
SHAPES = [((6, 5), False), ((6,), True), ((3, 6), False), ((3,), True)]
PAD = 3  # DDP-like padding after the last param


def _build(flat, *, target="torch.optim.AdamW", scaler=None, dtype=torch.bfloat16, views=True):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(dtype)) for s, _ in SHAPES]
    specs = [ShardSpec(s, no_weight_decay=nd) for s, nd in SHAPES]
    buf = torch.zeros(sum(p.numel() for p in params) + PAD)
    grads, off = {}, 0
    for p in reversed(params):  # buffer order: reverse registration, as GradBuffer
        grads[p] = buf[off:off + p.numel()].view(p.shape)
        off += p.numel()
    factory = build_optimizer_factory(OptimConfig(_target_=target, lr=0.01, weight_decay=0.1))
    opt = MixedPrecisionOptimizer(factory, params, specs, (lambda p: grads[p]) if views else (lambda p: p.grad), SOLO,
                                  scaler=scaler, clip_grad=1.0, max_consecutive_skips=0, flat_adam_step=flat)
    return opt, params, grads


def _set_grads(grads, step):
    gen = torch.Generator().manual_seed(step)
    for g in grads.values():
        g.copy_(torch.randn(g.shape, generator=gen) * 3)
    if step == 2:
        next(iter(grads.values())).view(-1)[1] = float("inf")


def test_main_params_model_params_and_moments_are_views_at_the_grad_offsets():
    opt, params, grads = _build(True)
    _set_grads(grads, 0)
    opt.step()
    (buf,) = opt.flat_step.buffers
    assert buf.main.numel() == buf.grad.numel() == sum(p.numel() for p in params) + PAD
    for e in opt.entries:
        start = grads[e.model_param].storage_offset()
        state = opt.optimizer.state[e.main]
        for view, flat in ((e.main, buf.main), (e.model_param, buf.model), (state["exp_avg"], buf.exp_avg),
                           (state["exp_avg_sq"], buf.exp_avg_sq)):
            assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert view.storage_offset() == start and view.shape == e.model_param.shape
    decayed = {id(p) for p in opt.optimizer.param_groups[0]["params"]}
    assert [int(buf.group[grads[e.model_param].storage_offset()]) for e in opt.entries] == \
        [0 if id(e.main) in decayed else 1 for e in opt.entries] == [0, 1, 0, 1]
    assert torch.equal(buf.main[-PAD:], torch.zeros(PAD))  # padding stays zero


@pytest.mark.parametrize("target", ["torch.optim.AdamW", "torch.optim.Adam"])
def test_flat_step_takes_torch_fused_adams_step(target):
    """Five steps, the clip active (max norm 1 against norms ~10), a grad scale, an inf at step 2: the same
    norms and skips as torch's fused kernel, main params and moments to fp32 rounding (torch's CPU kernel
    orders its float operations differently), model params the main params rounded, a skip changes nothing."""
    (flat, _, fgrads), (ref, _, rgrads) = _build(True, target=target), _build(False, target=target)
    assert flat.flat_step is not None and ref.flat_step is None
    for step in range(5):
        _set_grads(fgrads, step)
        _set_grads(rgrads, step)
        before = [t.clone() for e in flat.entries for t in (e.main.detach(), flat.optimizer.state[e.main]["exp_avg"])] \
            if step == 2 else None
        a = flat.step(grad_scale=torch.tensor(1.7))
        b = ref.step(grad_scale=torch.tensor(1.7))
        assert a.update_successful == b.update_successful == (step != 2)
        assert a.grad_norm == b.grad_norm
        if before is not None:
            after = [t for e in flat.entries for t in (e.main.detach(), flat.optimizer.state[e.main]["exp_avg"])]
            assert all(torch.equal(x, y) for x, y in zip(before, after))
        for x, y in zip(flat.entries, ref.entries):
            assert torch.equal(x.model_param.detach(), x.main.detach().to(torch.bfloat16))
            torch.testing.assert_close(x.main.detach(), y.main.detach(), rtol=1e-6, atol=1e-8)
            sx, sy = flat.optimizer.state[x.main], ref.optimizer.state[y.main]
            assert float(sx["step"]) == float(sy["step"]) == (step if step >= 2 else step + 1)
            torch.testing.assert_close(sx["exp_avg"], sy["exp_avg"], rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(sx["exp_avg_sq"], sy["exp_avg_sq"], rtol=1e-6, atol=1e-9)
        flat.zero_grad()
        ref.zero_grad()


def test_flat_math_by_hand():
    """One element per group through `flat_adam_math`, against AdamW written out in float64."""
    p0, g0, m0, v0 = [0.5, -0.25], [0.2, -0.4], [0.01, 0.02], [0.001, 0.002]
    t = dict(param=torch.tensor(p0), grad=torch.tensor(g0), exp_avg=torch.tensor(m0), exp_avg_sq=torch.tensor(v0),
             model_param=torch.zeros(2, dtype=torch.bfloat16), group=torch.tensor([0, 1], dtype=torch.uint8))
    hyper = torch.tensor([[0.1, 0.5], [0.1, 0.0]], dtype=torch.float64)
    consts = torch.tensor([0.9, 0.99, 1 - 0.9, 1 - 0.99, 1e-3], dtype=torch.float64)
    flat_adam_math(**t, hyper=hyper, consts=consts, step=torch.tensor(3.0), divisor=torch.tensor(2.0),
                   found_inf=torch.tensor(0.0), decoupled=True)
    for i, wd in enumerate((0.5, 0.0)):
        g = g0[i] / 2.0
        m = 0.9 * m0[i] + 0.1 * g
        v = 0.99 * v0[i] + 0.01 * g * g
        p = p0[i] * (1 - 0.1 * wd) - 0.1 / (1 - 0.9**3) * m / (v**0.5 / (1 - 0.99**3) ** 0.5 + 1e-3)
        assert t["exp_avg"][i].item() == pytest.approx(m, rel=1e-6)
        assert t["exp_avg_sq"][i].item() == pytest.approx(v, rel=1e-6)
        assert t["param"][i].item() == pytest.approx(p, rel=1e-6)
    assert torch.equal(t["model_param"], t["param"].to(torch.bfloat16))


def test_checkpoint_state_crosses_between_flat_and_torch_steps():
    """A flat optimizer's state_dict is torch's (per-param moments and steps): loaded into a fresh flat
    optimizer (re-bound at its next step) the next step equals the saver's bitwise; loaded into torch's
    path it continues to fp32 rounding."""
    saver, _, sgrads = _build(True)
    for step in range(2):
        _set_grads(sgrads, step)
        saver.step()
    sd = copy.deepcopy(saver.state_dict())  # as a checkpoint file would: no tensor shared with the saver
    resumed, _, rgrads = _build(True)
    torch_path, _, tgrads = _build(False)
    resumed.load_state_dict(sd)
    torch_path.load_state_dict(sd)
    assert not resumed.flat_step.state_is_bound()
    for opt, grads in ((saver, sgrads), (resumed, rgrads), (torch_path, tgrads)):
        _set_grads(grads, 3)
        opt.step()
    assert resumed.flat_step.state_is_bound()
    for x, y, z in zip(saver.entries, resumed.entries, torch_path.entries):
        assert torch.equal(x.main, y.main) and torch.equal(x.model_param, y.model_param)
        assert torch.equal(saver.optimizer.state[x.main]["exp_avg_sq"], resumed.optimizer.state[y.main]["exp_avg_sq"])
        assert float(resumed.optimizer.state[y.main]["step"]) == 3.0
        torch.testing.assert_close(x.main.detach(), z.main.detach(), rtol=1e-6, atol=1e-8)


def test_flat_step_only_where_it_applies(caplog):
    assert _build(False)[0].flat_step is None  # the default
    assert "precision.flat_adam_step=false" in _build(False)[0].flat_step_note
    assert _build(True, scaler=ConstantLossScaler(8.0))[0].flat_step is None  # no folded step
    assert _build(True, target="torch.optim.SGD")[0].flat_step is None
    assert _build(True, dtype=torch.float32)[0].flat_step is None  # no main copies
    opt = _build(True, views=False)[0]  # p.grad is None at construction: no buffer to lay out on
    assert opt.flat_step is None and "grad" in opt.flat_step_note
    assert "does not apply" in caplog.text


def test_grads_moved_off_the_layout_fall_back_to_torchs_kernel(caplog):
    """grad_fn must return the same views every step; if it stops doing so, the flat step stands down with
    one warning and torch's kernel steps the same (flat-viewed) params and state from then on."""
    opt, params, grads = _build(True)
    ref, _, rgrads = _build(False)
    for p in list(grads):
        grads[p] = grads[p].clone()  # new storage: no longer the buffer the layout was built on
    for step in range(2):
        _set_grads(grads, step)
        _set_grads(rgrads, step)
        opt.step()
        ref.step()
    assert opt.flat_step is None and caplog.text.count("no longer the views") == 1
    for x, y in zip(opt.entries, ref.entries):
        assert torch.equal(x.main, y.main) and torch.equal(x.model_param, y.model_param)


def test_replaced_param_data_and_changed_betas_fall_back_to_torchs_kernel(caplog):
    """A model param re-assigned after the layout (a re-init, ``model.to``) keeps training, through torch's
    kernel, as with the flag off; betas / eps changed at run time reach the flat kernel (read each step)."""
    opt, params, grads = _build(True)
    ref, rparams, rgrads = _build(False)
    for o in (opt, ref):
        o.optimizer.param_groups[0]["betas"] = o.optimizer.param_groups[1]["betas"] = (0.8, 0.95)
        o.optimizer.param_groups[0]["eps"] = o.optimizer.param_groups[1]["eps"] = 1e-3
    _set_grads(grads, 0)
    _set_grads(rgrads, 0)
    opt.step()
    ref.step()
    assert opt.flat_step is not None
    for x, y in zip(opt.entries, ref.entries):
        torch.testing.assert_close(x.main.detach(), y.main.detach(), rtol=1e-6, atol=1e-8)
    for p in (params[0], rparams[0]):
        with torch.no_grad():
            p.data = torch.zeros_like(p)
    opt.reload_model_params()
    ref.reload_model_params()
    for step in (1, 3):
        _set_grads(grads, step)
        _set_grads(rgrads, step)
        opt.step()
        ref.step()
    assert opt.flat_step is None and "param's .data was replaced" in caplog.text
    assert not torch.equal(params[0], torch.zeros_like(params[0]))  # it trains
    for x, y in zip(opt.entries, ref.entries):
        torch.testing.assert_close(x.main.detach(), y.main.detach(), rtol=1e-6, atol=1e-8)
        assert torch.equal(x.model_param.detach(), x.main.detach().to(torch.bfloat16))
