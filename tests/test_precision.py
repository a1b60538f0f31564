"""Optimizer wrappers (skips, counters, main params, sharded_state_dict) and Float16Module, single process and gloo."""

import copy
import types

import pytest
import torch

from harness import run_distributed
from mptrain.config.optim import OptimConfig
from mptrain.groups import build_groups
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import build_optimizer_factory
from mptrain.precision import (
    ConstantLossScaler,
    DynamicLossScaler,
    Float16Module,
    FP32Optimizer,
    MixedPrecisionOptimizer,
    TooManySkippedStepsError,
    WrapperState,
)
from mptrain.precision.module import round_params_to

# A world of one without torch.distributed: no group to reduce over.
SOLO = types.SimpleNamespace(mp_group=None, tp_rank=0, device=torch.device("cpu"))


def _model(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter((torch.randn(4, 3, generator=gen) * 0.5).to(dtype))
    b = torch.nn.Parameter(torch.randn(4, generator=gen).to(dtype))
    return [w, b], [ShardSpec((4, 3)), ShardSpec((4,), no_weight_decay=True)]


def _wrap(params, specs, *, scaler=None, clip=0.0, max_skips=0, target="torch.optim.AdamW", groups=SOLO, wd=0.1):
    cls = FP32Optimizer if params[0].dtype == torch.float32 else MixedPrecisionOptimizer
    factory = build_optimizer_factory(OptimConfig(_target_=target, lr=0.01, weight_decay=wd))
    return cls(factory, params, specs, lambda p: p.grad, groups, scaler=scaler, clip_grad=clip,
               max_consecutive_skips=max_skips)


def _set_grads(params, seed, scale=1.0, poison=False):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
    if poison:
        params[0].grad.view(-1)[1] = float("inf")


def _snapshot(opt):
    return (
        [e.model_param.detach().clone() for e in opt.entries],
        [e.main.detach().clone() for e in opt.entries],
        copy.deepcopy(opt.optimizer.state_dict()["state"]),
    )


def _assert_same(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        for key, v in a[2][k].items():
            assert torch.equal(v, b[2][k][key])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_main_params_are_fp32_copies_and_round_trip(dtype):
    params, specs = _model(dtype)
    opt = _wrap(params, specs, scaler=ConstantLossScaler(1.0))
    mains = [e.main for e in opt.entries]
    assert [m.dtype for m in mains] == [torch.float32, torch.float32]
    assert all(m is not p for m, p in zip(mains, params))
    listed = opt.sharded_state_dict().params  # what a checkpoint saves: the main copies, per model param
    assert [(p.param, p.main) for p in listed] == list(zip(params, mains))
    for p, m in zip(params, mains):
        assert torch.equal(m.to(dtype), p)  # fp16/bf16 -> fp32 is exact, so the round trip is the identity
    # the inner optimizer steps the main params, with no weight decay on the bias
    assert [g["params"] for g in opt.param_groups] == [[mains[0]], [mains[1]]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for step in range(3):
        _set_grads(params, step)
        result = opt.step().result()
        assert result.update_successful and not result.found_inf
        for p, m in zip(params, mains):
            assert p.dtype == dtype
            assert torch.equal(p, m.detach().to(dtype))  # model params = main params rounded to nearest
        opt.zero_grad()
        assert all(p.grad is None for p in params) and all(m.grad is None for m in mains)
    # the fp32 main params kept what the low-precision model params cannot hold
    assert any(not torch.equal(m.detach(), p.float()) for p, m in zip(params, mains))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounded_fp32_params_are_the_main_params_of_the_cast_model(dtype):
    """ZeRO-2 / ZeRO-3's fp32 master weights start as DDP's: `round_params_to` leaves in each fp32 param the fp32 main
    param that `MixedPrecisionOptimizer` makes of the `Float16Module`-cast model, norms included; buffers untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    for p in model[1].parameters():
        p.data.normal_()  # not exact in 16 bits (a trained norm)
    model.register_buffer("counts", torch.rand(4))
    init = copy.deepcopy(model)
    fp32 = copy.deepcopy(model)
    round_params_to(fp32, dtype)
    cast = Float16Module(model, dtype, is_first_stage=True, is_last_stage=True)
    params = list(cast.parameters())
    opt = _wrap(params, [ShardSpec(tuple(p.shape)) for p in params])
    rounded = list(fp32.parameters())
    assert [p.dtype for p in rounded] == [torch.float32] * 4
    assert all(torch.equal(p, e.main) for p, e in zip(rounded, opt.entries))
    assert all(not torch.equal(p, q) for p, q in zip(rounded, init.parameters()))  # every fp32 param moved
    assert torch.equal(fp32.counts, init.counts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_precision_step_equals_fp32_step_on_the_main_params(dtype):
    params, specs = _model(dtype)
    ref_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = _wrap(params, specs, scaler=ConstantLossScaler(1024.0) if dtype == torch.float16 else None, clip=1.0)
    ref = _wrap(ref_params, specs, clip=1.0)
    for step in range(3):
        _set_grads(params, step, scale=1024.0 if dtype == torch.float16 else 1.0)
        _set_grads(ref_params, step)
        for p, r in zip(params, ref_params):  # the reference sees the same (rounded) unscaled grads
            r.grad = p.grad.float() / (1024.0 if dtype == torch.float16 else 1.0)
        a, b = opt.step().result(), ref.step().result()
        # 1e-6: the fp16 grads times 1024 are exact; unscaling by 2^-10 is exact; same fp32 math after that
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
        for m, r in zip([e.main for e in opt.entries], ref_params):
            torch.testing.assert_close(m.detach(), r.detach(), rtol=1e-6, atol=1e-7)  # same fp32 ops, same order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_grad_scale_in_the_unscale_pass_equals_scaling_the_grads_first(dtype):
    """step(grad_scale=f) (the trainer's token normalisation, folded into the unscale pass) takes the
    same step as multiplying every grad by f first (what finalize_model_grads does by default):
    clipped norm, main params and Adam state, over three steps with a factor that is not 1."""
    params, specs = _model(dtype)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loss_scale = 1024.0 if dtype == torch.float16 else None
    opt = _wrap(params, specs, scaler=ConstantLossScaler(loss_scale) if loss_scale else None, clip=0.5)
    ref = _wrap(ref_params, specs, scaler=ConstantLossScaler(loss_scale) if loss_scale else None, clip=0.5)
    factor = torch.tensor(8192.0 / 6011.0, dtype=torch.float64)  # max_tokens / masked tokens
    for step in range(3):
        _set_grads(params, step, scale=loss_scale or 1.0)
        _set_grads(ref_params, step, scale=loss_scale or 1.0)
        for r in ref_params:
            r.grad = (r.grad.float() * float(factor)).to(r.dtype)  # scaled first, in the grads' dtype
        a, b = opt.step(grad_scale=factor).result(), ref.step().result()
        assert a.update_successful and b.update_successful
        # one rounding of the factor into the grads differs: fp32 grads agree to ~1 ulp, fp16/bf16 to their own
        tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=tol)
        for m, r in zip([e.main for e in opt.entries], [e.main for e in ref.entries]):
            torch.testing.assert_close(m.detach(), r.detach(), rtol=tol, atol=tol * 1e-2)
        opt.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("clip", [0.0, 0.5, 100.0])
@pytest.mark.parametrize("with_grad_scale", [False, True])
def test_folded_step_equals_the_five_pass_step(dtype, clip, with_grad_scale):
    """bf16 / fp32 with torch's fused AdamW: the folded step (norm pass, then grad scale and clip
    coefficient divided out inside the fused kernel) takes the step of the unfolded one (unscale
    pass, norm, clip pass, Adam): same norm, main params and Adam state over three steps, with the
    clip active (0.5), inactive (100) and off (0)."""
    params, specs = _model(dtype)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = _wrap(params, specs, clip=clip)
    factory = build_optimizer_factory(OptimConfig(_target_="torch.optim.AdamW", lr=0.01, weight_decay=0.1))
    cls = type(opt)
    ref = cls(factory, ref_params, specs, lambda p: p.grad, SOLO, scaler=None, clip_grad=clip, max_consecutive_skips=0,
              fold_into_fused_step=False)
    assert opt.folded_step and not ref.folded_step and opt.optimizer.defaults["fused"]
    factor = torch.tensor(8192.0 / 6011.0, dtype=torch.float64) if with_grad_scale else None
    for step in range(3):
        _set_grads(params, step, scale=3.0)
        _set_grads(ref_params, step, scale=3.0)
        a, b = opt.step(grad_scale=factor).result(), ref.step(grad_scale=factor).result()
        assert a.update_successful and b.update_successful
        # the grads are multiplied by (factor x coef) once vs divided by 1 / (factor x coef): fp32 ulps
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
        for m, r in zip([e.main for e in opt.entries], [e.main for e in ref.entries]):
            torch.testing.assert_close(m.detach(), r.detach(), rtol=1e-6, atol=1e-8)
        for sa, sb in zip(opt.optimizer.state.values(), ref.optimizer.state.values()):
            torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-12)
        opt.zero_grad()
        ref.zero_grad()
    assert not hasattr(opt.optimizer, "grad_scale")  # not left for a later, unfolded use


def test_folded_step_only_where_it_applies():
    """Not with a loss scaler (fp16: the unscale pass also feeds the scaler), not with SGD (no Adam
    kernel), not when switched off."""
    params, specs = _model(torch.bfloat16)
    assert _wrap(params, specs).folded_step
    assert not _wrap(params, specs, scaler=ConstantLossScaler(1.0)).folded_step
    assert not _wrap(params, specs, target="torch.optim.SGD").folded_step
    f16, s16 = _model(torch.float16)
    assert not _wrap(f16, s16, scaler=ConstantLossScaler(8.0)).folded_step


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_skipped_step_changes_no_weight_and_no_optimizer_state(dtype):
    params, specs = _model(dtype)
    scaler = DynamicLossScaler(2.0**16, 1.0, 2.0, 0.5, 1000, 1) if dtype == torch.float16 else None
    opt = _wrap(params, specs, scaler=scaler)
    _set_grads(params, 0)
    assert opt.step().result().update_successful  # one real step so that Adam has state to protect
    opt.zero_grad()
    before = _snapshot(opt)
    _set_grads(params, 1, poison=True)
    result = opt.step().result()
    assert (result.update_successful, result.grad_norm, result.num_zeros, result.found_inf) == (False, None, None, True)
    _assert_same(before, _snapshot(opt))
    assert all(m.grad is None for m in [e.main for e in opt.entries])  # the poisoned grads are dropped
    assert opt.skipped_iters_total == 1 and opt.consecutive_skips == 1
    if dtype == torch.float16:
        assert opt.nan_iters_total == 0  # an expected overflow of the dynamic scaler
        assert opt.get_loss_scale() == 2.0**15  # hysteresis 1: backed off at once
    else:
        assert opt.nan_iters_total == 1  # no scaler to explain it: a NaN iteration
        assert opt.get_loss_scale() == 1.0
    opt.zero_grad()
    _set_grads(params, 2)
    assert opt.step().result().update_successful
    assert opt.consecutive_skips == 0 and opt.skipped_iters_total == 1


def test_max_consecutive_skips_raises_with_the_key():
    params, specs = _model(torch.float16)
    opt = _wrap(params, specs, scaler=DynamicLossScaler(4.0, 1.0, 2.0, 0.5, 1000, 1), max_skips=3)
    for _ in range(3):
        _set_grads(params, 0, poison=True)
        assert not opt.step().result().update_successful
    _set_grads(params, 0, poison=True)
    with pytest.raises(TooManySkippedStepsError, match=r"4 consecutive steps .*loss scale 1\).*max_consecutive_skips=3"):
        opt.step().result()


def test_fp32_optimizer_rejects_half_params_and_has_no_copies():
    params, specs = _model(torch.float32)
    opt = _wrap(params, specs)
    assert [e.main for e in opt.entries] == params and [e.main for e in opt.entries][0] is params[0]
    assert [p.main for p in opt.sharded_state_dict().params] == [None, None]  # no copies to save
    half, hspecs = _model(torch.float16)
    with pytest.raises(ValueError, match="FP32Optimizer: param dtype torch.float16"):
        FP32Optimizer(build_optimizer_factory(OptimConfig()), half, hspecs, lambda p: p.grad, SOLO,
                      scaler=None, clip_grad=0.0, max_consecutive_skips=0)


def test_grad_fn_with_an_fp32_buffer_for_bf16_params():
    params, specs = _model(torch.bfloat16)
    buffers = {id(p): torch.zeros(p.shape, dtype=torch.float32) for p in params}  # grad_reduce_in_fp32 main_grad
    opt = MixedPrecisionOptimizer(build_optimizer_factory(OptimConfig(_target_="torch.optim.SGD", lr=1.0)), params, specs,
                                  lambda p: buffers[id(p)], SOLO, scaler=None, clip_grad=0.0, max_consecutive_skips=0)
    before = [m.detach().clone() for m in [e.main for e in opt.entries]]
    for b in buffers.values():
        b.fill_(0.25)
    assert opt.step().result().update_successful
    for m, b0 in zip([e.main for e in opt.entries], before):
        assert torch.equal(m.detach(), b0 - 0.25)  # fp32 main grads used as they are (no bf16 rounding)


@pytest.mark.parametrize("dtype, scaler", [(torch.float16, "dynamic"), (torch.bfloat16, None), (torch.float32, None)])
def test_optimizer_state_dict_round_trip(dtype, scaler):
    def make():
        params, specs = _model(dtype)
        s = DynamicLossScaler(2.0**8, 1.0, 2.0, 0.5, 2, 1) if scaler else None
        return params, _wrap(params, specs, scaler=s, clip=1.0)

    params, opt = make()
    for step in range(4):
        _set_grads(params, step, poison=(step == 1))
        opt.step().result()
        opt.zero_grad()
    saved = copy.deepcopy(opt.sharded_state_dict())  # copies: what a checkpoint writes
    assert saved.counters == {"skipped_iters_total": 1, "nan_iters_total": 0 if scaler else 1, "consecutive_skips": 0}
    params2, opt2 = make()
    with torch.no_grad():  # the model weights come from the model checkpoint, not from the optimizer's
        for p2, p in zip(params2, params):
            p2.copy_(p)
    own = opt2.sharded_state_dict()
    with torch.no_grad():  # as the checkpoint loads: main params filled in place, the state handed over
        for mine, theirs in zip(own.params, saved.params):
            if mine.main is not None:
                mine.main.copy_(theirs.main)
            mine.state = theirs.state
    opt2.load_sharded_state_dict(WrapperState(params=own.params, scaler=saved.scaler, counters=saved.counters))
    assert opt2.get_loss_scale() == opt.get_loss_scale()
    assert (opt2.skipped_iters_total, opt2.nan_iters_total) == (opt.skipped_iters_total, opt.nan_iters_total)
    _assert_same(_snapshot(opt), _snapshot(opt2))
    for step in range(4, 7):  # continuing gives bitwise the same trajectory
        _set_grads(params, step)
        _set_grads(params2, step)
        assert opt.step().result() == opt2.step().result()
        for a, b in zip(params + [e.main for e in opt.entries], params2 + [e.main for e in opt2.entries]):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="the params are not the ones sharded_state_dict listed"):
        opt2.load_sharded_state_dict(WrapperState(params=own.params[:1]))
    with pytest.raises(ValueError, match="the params are not the ones sharded_state_dict listed"):
        opt2.load_sharded_state_dict(WrapperState(params=saved.params))  # another wrapper's params


def test_lr_scheduler_drives_the_wrapper():
    from mptrain.optim import OptimizerParamScheduler

    params, specs = _model(torch.bfloat16)
    opt = _wrap(params, specs)
    sched = OptimizerParamScheduler(opt, lr=1.0, min_lr=0.0, lr_warmup_iters=4, lr_decay_iters=None, lr_decay_style="constant")
    sched.step()
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.25, 0.25]


# --- gloo: found_inf is reduced with MAX over the model-parallel group ---------------------------------------------
def _poison_one_rank(rank, world, poisoned_rank, dtype):
    groups = build_groups(world, 1)  # tp = world: the mp group holds both ranks
    try:
        params, specs = _model(dtype, seed=rank)  # replicated specs: counted in the norm on tp rank 0 only
        scaler = DynamicLossScaler(2.0**10, 1.0, 2.0, 0.5, 1000, 1) if dtype == torch.float16 else None
        opt = _wrap(params, specs, scaler=scaler, groups=groups)
        assert opt.folded_step == (scaler is None)
        before = [p.detach().clone() for p in params + [e.main for e in opt.entries]]
        _set_grads(params, rank, poison=(rank == poisoned_rank))
        skipped = opt.step().result()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, params + [e.main for e in opt.entries]))
        opt.zero_grad()
        _set_grads(params, 10 + rank)
        clean = opt.step().result()
        return skipped.update_successful, skipped.found_inf, unchanged, clean.update_successful, opt.get_loss_scale(), \
            opt.skipped_iters_total
    finally:
        groups.destroy()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("poisoned_rank", [0, 1])
def test_found_inf_on_one_rank_skips_on_both(poisoned_rank, dtype):
    """fp16: the unscale pass finds it; bf16 / fp32 (folded step): the non-finite count, which also
    checks grads that do not count in the norm (rank 1's replicated copies)."""
    out = run_distributed(_poison_one_rank, 2, poisoned_rank, dtype)
    scale = 2.0**9 if dtype == torch.float16 else 1.0
    assert out == [(False, True, True, True, scale, 1)] * 2


# --- Float16Module ----------------------------------------------------------------------------------------------
class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.received = None

    def set_input_tensor(self, t):
        self.received = t

    def forward(self, x, ids, mask=None):
        assert ids.dtype == torch.int64 and (mask is None or mask.dtype == torch.bool)
        return self.lin(x), ids


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float16_module_casts(dtype):
    toy = _Toy()
    ref_w = toy.lin.weight.detach().clone()
    m = Float16Module(toy, dtype, is_first_stage=True, is_last_stage=True)
    assert {p.dtype for p in m.parameters()} == {dtype}
    assert torch.equal(m.module.lin.weight, ref_w.to(dtype))
    x = torch.randn(5, 3)
    out, ids = m(x, torch.arange(5), mask=torch.zeros(5, dtype=torch.bool))
    assert out.dtype == torch.float32 and ids.dtype == torch.int64
    expected = torch.nn.functional.linear(x.to(dtype), toy.lin.weight, toy.lin.bias).float()
    assert torch.equal(out, expected)  # the computation ran in `dtype`; only the output was upcast
    m.set_input_tensor(torch.ones(2, dtype=dtype))
    assert torch.equal(toy.received, torch.ones(2, dtype=dtype))


def test_float16_module_middle_stage_keeps_dtypes():
    m = Float16Module(_Toy(), torch.float16, is_first_stage=False, is_last_stage=False)
    with pytest.raises(RuntimeError):  # not first stage: an fp32 input is not cast, so the fp16 linear rejects it
        m(torch.randn(5, 3), torch.arange(5))
    out, _ = m(torch.randn(5, 3, dtype=torch.float16), torch.arange(5))
    assert out.dtype == torch.float16  # not last stage: activations stay fp16 for the next stage
    with pytest.raises(ValueError, match="must be torch.float16 or torch.bfloat16"):
        Float16Module(_Toy(), torch.float32, is_first_stage=True, is_last_stage=True)
