"""precision=fp8 on CPU with torchao's emulation (the same scaling and FP8 rounding, GEMMs in fp32).

1. One linear's FP8 GEMMs equal torchao's own ``Float8Linear`` (output, input grad, weight grad), per recipe.
2. An fc1 -> GeLU -> fc2 pair at tp2 (with and without sequence parallelism) computes the scales of tp1:
   every element whose GEMM contracts over a whole dim (the column-parallel output, both weight grads)
   is bitwise the tp1 slice; the row-parallel output and the column-parallel input grad, summed over
   TP, differ from tp1 only by the bf16 rounding of partial sums.
3. Through the trainer: tp2pp2 (with full recompute), tp2 + SP + dp2 with ZeRO-1 and pp2 + dp2 with ZeRO-1
   train like tp1pp1 in fp8; a resume
   is bitwise; a run switches between bf16 and fp8 on resume with one log line; the error lines.

Tolerances of 3: the scales are those of tp1 (2), so layouts with TP differ only in the summation order
of bf16 partial sums (the TP reduces), as bf16 layouts do; an FP8 cast can turn a one-ulp bf16
difference into a one-step FP8 difference (2^-3 relative for e4m3) of that element, which averages
out in the loss but less in the grad norm. Over 3 steps of the tiny model: the loss to rel 2e-3 (half
a bf16 ulp, 2^-8), the grad norm to rel 2e-2 (bf16 parity's 1e-4 would need bitwise-equal casts).
That noise is as large as wrong scales would make it at this size (tp2 + SP at step 1: grad norm 3.5e-3
from tp1 with the TP amax reductions and without them), so the scales themselves are asserted bitwise
in 2, and these jobs check that the layouts carry FP8 through the trainer. Without TP (pp2, dp2 with
ZeRO-1) every cast sees tp1's bf16 values and only the fp32 summation order of grads differs: loss and
grad norm to rel 1e-5 (measured on one machine: the loss bitwise, the grad norm 3e-7).
"""

import dataclasses

import pytest
import torch

from harness import run_distributed
from train_utils import compose, read_rows, run_job

pytest.importorskip("torchao.float8")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _pair(groups, sequence_parallel, recipe):
    """fc1 [h -> f] column-parallel with a bias (zeros: its grad takes the output grad's amax beside it,
    `Fp8Gemms.cast_grad_output`), fc2 [f -> h] row-parallel, bf16, FP8 on (tp from ``groups``)."""
    from mptrain.layers.context import LayerContext
    from mptrain.layers.fp8 import IN_FP8, Fp8Recipe
    from mptrain.layers.linear import ColumnParallelLinear, RowParallelLinear
    from mptrain.layers.random import ParamInit

    ctx = LayerContext(groups=groups, init=ParamInit(seed=5, std=0.05, num_layers=2), params_dtype=torch.bfloat16,
                       sequence_parallel=sequence_parallel)
    fc1 = ColumnParallelLinear(64, 128, context=ctx, name="fc1", bias=True)
    fc2 = RowParallelLinear(128, 64, context=ctx, name="fc2", bias=False)
    on = Fp8Recipe(recipe=recipe, emulate=True, gemm_filter="none")
    assert fc1.enable_fp8(on) == fc2.enable_fp8(on) == IN_FP8
    return fc1, fc2


def _run_pair(groups, sequence_parallel, recipe, cached=False):
    """The pair's forward and backward; ``cached``: inside `Fp8WeightCasts.cached` (tensorwise), entered once
    before with fc1's weight ×4 (a stale cast the second entry must replace)."""
    import contextlib

    from mptrain.layers import mappings
    from mptrain.layers.fp8 import Fp8WeightCasts

    fc1, fc2 = _pair(groups, sequence_parallel, recipe)
    casts = Fp8WeightCasts([m for m in (fc1, fc2) if m.fp8_weight_cast is not None])
    if cached:
        assert len(casts) == 2
        with torch.no_grad():
            fc1.weight.mul_(4)
            with casts.cached():
                pass
            fc1.weight.div_(4)
    gen = torch.Generator().manual_seed(7)
    x_full = torch.randn(16, 2, 64, generator=gen).to(torch.bfloat16)  # [s, b, h]
    dy_full = torch.randn(16, 2, 64, generator=gen).to(torch.bfloat16)
    x_full[3, 1, 5] = 9.0  # one outlier: a local amax that differs between TP ranks
    tp, r = groups.tp_size, groups.tp_rank
    x = (x_full.chunk(tp, 0)[r] if sequence_parallel else x_full).clone().requires_grad_(True)
    with casts.cached() if cached else contextlib.nullcontext():
        h, _ = fc1(x)  # [s, b, f/tp]
        h.retain_grad()
        y, _ = fc2(torch.nn.functional.gelu(h))
        y.backward(dy_full.chunk(tp, 0)[r] if sequence_parallel else dy_full)
    gather = lambda t: mappings.gather_from_tp_region(t, groups.tp_group)  # noqa: E731 [.., local] -> [.., full]
    x_grad = x.grad
    if sequence_parallel:
        y = mappings.gather_from_sequence_parallel_region_raw(y.contiguous(), groups.tp_group)
        x_grad = mappings.gather_from_sequence_parallel_region_raw(x_grad, groups.tp_group)
    return dict(h=gather(h.detach()), y=y.detach(), x_grad=x_grad, w1_grad=gather(fc1.weight.grad.t()).t(),
                w2_grad=gather(fc2.weight.grad), b1_grad=gather(fc1.bias.grad))


def _torchao_reference(recipe):
    """tp1: our ColumnParallelLinear in FP8 vs torchao's Float8Linear on the same weight (bitwise)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from mptrain.groups import build_groups

    g = build_groups(1, 1)
    try:
        fc1, _ = _pair(g, False, recipe)
        config = Float8LinearConfig.from_recipe_name(recipe)
        config = Float8LinearConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, "emulate": True})
        lin = torch.nn.Linear(64, 128, bias=False).to(torch.bfloat16)
        lin.weight.data.copy_(fc1.weight.data)
        ref = Float8Linear.from_float(lin, config=config)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(16, 2, 64, generator=gen).to(torch.bfloat16)
        dy = torch.randn(16, 2, 128, generator=gen).to(torch.bfloat16)
        out = []
        for module in (lambda t: fc1(t)[0], ref):
            xi = x.clone().requires_grad_(True)
            y = module(xi)
            y.backward(dy)
            out.append((y.detach(), xi.grad))
        grads = (fc1.weight.grad, ref.weight.grad)
        return (all(torch.equal(a, b) for a, b in zip(out[0], out[1])) and torch.equal(*grads),
                float((out[0][0].float() - out[0][0].float().to(torch.bfloat16).float()).abs().max()))
    finally:
        g.destroy()


def _reads_cast_made_on_entry(groups) -> bool:
    """Inside `Fp8WeightCasts.cached` the forward uses the cast made on entry, not the weight as it is now: fc1's
    weight ×4 after entry leaves the output as it was (outside, the same change scales it by 4)."""
    from mptrain.layers.fp8 import Fp8WeightCasts

    fc1, _ = _pair(groups, False, "tensorwise")
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    with torch.no_grad():
        plain = fc1(x)[0]
        with Fp8WeightCasts([fc1]).cached():
            fc1.weight.mul_(4)
            inside = fc1(x)[0]
        outside = fc1(x)[0]
    return torch.equal(inside, plain) and torch.equal(outside, 4 * plain)


def _run_pair_cp(groups, recipe):
    """`_run_pair`'s tensors with the tokens split over CP (each rank its half of s, tp 1): h, y and x_grad gathered
    over CP on the sequence, the weight and bias grads summed over CP (each rank's are its tokens' partial sums)."""
    import torch.distributed as dist

    fc1, fc2 = _pair(groups, False, recipe)
    gen = torch.Generator().manual_seed(7)
    x_full = torch.randn(16, 2, 64, generator=gen).to(torch.bfloat16)  # [s, b, h], as `_run_pair`
    dy_full = torch.randn(16, 2, 64, generator=gen).to(torch.bfloat16)
    x_full[3, 1, 5] = 9.0  # the outlier on CP rank 0's tokens: rank 1's local amax is smaller
    cp, r = groups.cp_size, groups.cp_rank
    x = x_full.chunk(cp, 0)[r].clone().requires_grad_(True)
    h, _ = fc1(x)
    h.retain_grad()
    y, _ = fc2(torch.nn.functional.gelu(h))
    y.backward(dy_full.chunk(cp, 0)[r])

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(cp)]
        dist.all_gather(parts, t.contiguous(), group=groups.cp_group)
        return torch.cat(parts, 0)

    def summed(t):
        t = t.float()
        dist.all_reduce(t, group=groups.cp_group)
        return t.to(torch.bfloat16)

    return dict(h=gather(h.detach()), y=gather(y.detach()), x_grad=gather(x.grad), w1_grad=summed(fc1.weight.grad),
                w2_grad=summed(fc2.weight.grad), b1_grad=summed(fc1.bias.grad))


def _layers(rank, world):
    from mptrain.groups import build_groups

    results = {"torchao": {r: _torchao_reference(r)[0] for r in RECIPES}}
    g1 = build_groups(1, 1)
    try:
        ref = {r: _run_pair(g1, False, r) for r in RECIPES}
        cached = _run_pair(g1, False, "tensorwise", cached=True)
        results["cached"] = {k: torch.equal(cached[k], ref["tensorwise"][k]) for k in cached}
        results["reads_cast"] = _reads_cast_made_on_entry(g1)
    finally:
        g1.destroy()
    g2 = build_groups(world, 1)
    try:
        for sp in (False, True):  # the cached weight casts: bitwise the casts each GEMM makes, TP-reduced alike
            got, want = _run_pair(g2, sp, "tensorwise", cached=True), _run_pair(g2, sp, "tensorwise")
            results[("cached", sp)] = {k: torch.equal(got[k], want[k]) for k in got}
        for recipe in RECIPES:
            for sp in (False, True):
                got, want = _run_pair(g2, sp, recipe), ref[recipe]
                results[(recipe, sp)] = {
                    "exact": {k: torch.equal(got[k], want[k]) for k in ("h", "w1_grad", "w2_grad", "b1_grad")},
                    # summed over TP in bf16: within one bf16 rounding (2^-8 relative) of the largest element, twice
                    "close": {k: float((got[k].float() - want[k].float()).abs().max() / want[k].float().abs().max())
                              for k in ("y", "x_grad")}}
    finally:
        g2.destroy()
    cp2 = build_groups(1, 1, context_parallel_size=world)
    try:  # every CP rank casts with cp1's scales (amaxes over tokens reduced over CP): per token the same bits
        for recipe in RECIPES:
            got, want = _run_pair_cp(cp2, recipe), ref[recipe]
            results[(recipe, "cp")] = {
                "exact": {k: torch.equal(got[k], want[k]) for k in ("h", "y", "x_grad")},
                # partial sums over each rank's tokens, added in fp32 and rounded to bf16 once more
                "close": {k: float((got[k].float() - want[k].float()).abs().max() / want[k].float().abs().max())
                          for k in ("w1_grad", "w2_grad", "b1_grad")}}
    finally:
        cp2.destroy()
    return results


def _traced_graphs(rank, world):
    """Dynamo's graph and break counts for fc1 -> gelu -> fc2 in FP8 (every recipe, and tensorwise with the
    weight casts cached), tp 1."""
    import contextlib

    from mptrain.groups import build_groups
    from mptrain.layers.fp8 import Fp8WeightCasts

    g = build_groups(1, 1)
    try:
        counts = {}
        for recipe in (*RECIPES, "tensorwise_cached"):
            fc1, fc2 = _pair(g, False, recipe.removesuffix("_cached"))
            casts = Fp8WeightCasts([fc1, fc2]).cached() if recipe.endswith("_cached") else contextlib.nullcontext()

            def f(x):
                h, _ = fc1(x)
                return fc2(torch.nn.functional.gelu(h))[0]

            torch._dynamo.reset()
            with casts:
                explained = torch._dynamo.explain(f)(torch.randn(16, 2, 64, dtype=torch.bfloat16, requires_grad=True))
            counts[recipe] = (explained.graph_count, explained.graph_break_count,
                              [b.reason.splitlines()[0] for b in explained.break_reasons])
        return counts
    finally:
        g.destroy()


def test_fp8_linears_trace_as_one_graph():
    """The FP8 casts, amaxes and GEMMs trace without a graph break (a break per cast made a compiled chunk
    host-bound: one graph per cast instead of one per chunk)."""
    counts = run_distributed(_traced_graphs, 1)[0]
    assert counts == {r: (1, 0, []) for r in (*RECIPES, "tensorwise_cached")}, counts


def test_fp8_linears_equal_torchao_and_tp2_and_cp2_equal_tp1():
    for res in run_distributed(_layers, 2):
        assert res.pop("torchao") == {r: True for r in RECIPES}
        assert res.pop("reads_cast")
        for case in ("cached", ("cached", False), ("cached", True)):
            assert all(res.pop(case).values()), case
        for case, out in res.items():
            assert all(out["exact"].values()), (case, out)
            assert all(v <= 2 * 2**-8 for v in out["close"].values()), (case, out)


# --- through the trainer ----------------------------------------------------------------------
STEPS = 4  # the reference and the resume tests; the layout jobs run the first LAYOUT_STEPS of them
LAYOUT_STEPS = 3
BASE = ["model=tiny", "model.seq_length=32", "train.eval_interval=null",
        "train.global_batch_size=4", "train.micro_batch_size=1", "precision=fp8", "precision.fp8_emulate=true",
        "precision.fp8_gemm_filter=none"]


def test_fp8_grad_output_amax_beside_the_bias_grad_is_the_same_cast():
    """``cast_grad_output(with_bias_grad=True)`` takes dy's tensorwise amax as the max of its column amaxes (one
    reduction over tokens with the bias grad's): the same scale and bits as the whole-tensor amax, the max of
    any one column being the largest included."""
    from mptrain.layers.fp8 import Fp8Gemms, Fp8Recipe

    gemms = Fp8Gemms(Fp8Recipe(emulate=True), amax_group=None, input_sharded=False, output_sharded=False)
    dy = torch.randn(96, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    dy[17, 33] = -9.0  # the amax, in one column
    by_column, whole = (gemms.cast_grad_output(dy, with_bias_grad=b) for b in (True, False))
    assert float(by_column._scale) == float(whole._scale) == float(torch.tensor(57344.0) / 9.0)
    assert torch.equal(by_column._data.view(torch.uint8), whole._data.view(torch.uint8))


def test_fp8_kernels_line_says_which_gemms_run_in_fp8():
    """The start-up line's count of FP8 GEMMs per linear follows the recipe: rowwise_with_gw_hp keeps the weight-grad
    GEMM in bf16."""
    from mptrain.layers.fp8 import Fp8Recipe, Fp8Summary

    lines = {r: Fp8Summary(Fp8Recipe(recipe=r), fp8=4, num_layers=1).describe() for r in RECIPES}
    assert "4 of 4 block linears (3 GEMMs each) in FP8" in lines["tensorwise"]
    assert "4 of 4 block linears (3 GEMMs each) in FP8" in lines["rowwise"]
    assert "4 of 4 block linears (2 of 3 GEMMs each, the weight grad's in bf16) in FP8" in lines["rowwise_with_gw_hp"]


def _job(tmp, name, world, overrides, steps=STEPS, base=BASE):
    run_dir = tmp / name
    run_distributed(run_job, world, base + overrides + [f"train.train_iters={steps}", f"run.dir={run_dir}"],
                    timeout_s=300)
    return read_rows(run_dir), run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tp1pp1 run, which also saves a checkpoint at iteration 2 (the resume tests load it)."""
    tmp = tmp_path_factory.mktemp("fp8ref")
    rows, run_dir = _job(tmp, "tp1pp1", 1, ["parallel=tp1pp1", f"checkpoint.save={tmp / 'ckpt'}",
                                            "checkpoint.save_interval=2"])
    return rows, run_dir, tmp / "ckpt"


LAYOUTS = [  # every layout feature in three jobs: tp2 (no SP) + pp2 (+ recompute), tp2 + SP + dp2 with ZeRO-1,
    # and pp2 + dp2 with ZeRO-1 without TP (no bf16 partial sums: tp1's numbers but for fp32 summation order)
    ("tp2pp2_recompute", 4, ["parallel=tp2pp2", "model.recompute_granularity=full", "model.recompute_method=uniform",
                             "model.recompute_num_layers=1"]),
    ("tp2_sp_dp2_zero1", 4, ["parallel=tp2pp1", "parallel.sequence_parallel=true",
                             "parallel.use_distributed_optimizer=true"]),
    ("pp2_dp2_zero1", 4, ["parallel=tp1pp2", "parallel.use_distributed_optimizer=true"]),
]


@pytest.mark.parametrize("name,world,overrides", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_fp8_layouts_match_tp1pp1(tmp_path, reference, name, world, overrides):
    rows, _ = _job(tmp_path, name, world, overrides, steps=LAYOUT_STEPS)
    ref = reference[0]
    assert [r["iteration"] for r in rows] == list(range(1, LAYOUT_STEPS + 1))
    with_tp = name.startswith("tp2")
    for r, q in zip(rows, ref):
        where = (name, r["iteration"], r["lm_loss"], q["lm_loss"], r["grad_norm"], q["grad_norm"])
        if not with_tp:  # the same casts of the same bf16 values, up to fp32 summation order (DP, the norm)
            assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=1e-5), where
            assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-5), where
            continue
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=2e-3), where
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=2e-2), where


def test_fp8_resume_is_bitwise_and_switches_precision_both_ways(tmp_path, reference):
    ref, ref_dir, ckpt = reference
    assert "precision=fp8 (tensorwise, emulated: 16 of 16 block linears (3 GEMMs each) in FP8" in (ref_dir / "train.log").read_text()
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "tflops_per_gpu")} for r in rows]  # noqa: E731
    resumed, resumed_dir = _job(tmp_path, "resumed", 1, [f"checkpoint.load={ckpt}", "checkpoint.load_iteration=2"])
    assert strip(resumed) == strip(ref[2:])  # bitwise: the same floats in metrics.jsonl
    assert "precision changed" not in (resumed_dir / "train.log").read_text()
    bf16, bf16_dir = _job(tmp_path, "bf16", 1, [f"checkpoint.load={ckpt}", "checkpoint.load_iteration=2",
                                                "precision=bf16", f"checkpoint.save={tmp_path / 'bf16ck'}",
                                                "checkpoint.save_interval=2"],
                          base=[i for i in BASE if not i.startswith("precision.fp8_")])  # fp8-only keys: refused on bf16
    assert [r["iteration"] for r in bf16] == [3, 4] and bf16 != resumed
    assert abs(bf16[0]["lm_loss"] - ref[2]["lm_loss"]) < 0.05  # the same weights, now with bf16 GEMMs
    log = (bf16_dir / "train.log").read_text()
    assert log.count("checkpoint: precision changed fp8 -> bf16") == 1, log
    back, back_dir = _job(tmp_path, "fp8_again", 1, [f"checkpoint.load={tmp_path / 'bf16ck'}"], steps=STEPS + 1)
    assert [r["iteration"] for r in back] == [STEPS + 1]  # the bf16 run's iteration-4 checkpoint, now in fp8
    log = (back_dir / "train.log").read_text()
    assert log.count("checkpoint: precision changed bf16 -> fp8") == 1, log


def test_fp8_error_lines(monkeypatch):
    from mptrain.errors import ConfigError
    from mptrain.layers import fp8
    from mptrain.training.run import _validated

    cfg = compose(["model=tiny", "precision=fp8"])
    lines = []
    with pytest.raises(ConfigError, match=r"^precision=fp8 on CPU .* set precision.fp8_emulate=true") as err:
        fp8.check_fp8_environment(cfg.precision, cuda=False)
    lines.append(str(err.value))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigError, match=r"^precision=fp8 needs FP8 tensor cores \(sm89 or newer\), this GPU is sm80") as err:
        fp8.check_fp8_environment(cfg.precision, cuda=True)
    lines.append(str(err.value))

    monkeypatch.setattr(fp8, "_torchao_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"^precision=fp8 needs torchao; install it \(pip install -e .\[fp8\].*PYTHONPATH=.venv/fp8-site\)") as err:
        _validated(cfg, 1)  # the trainer's start-up check, before any process group exists
    lines.append(str(err.value))
    monkeypatch.setattr(fp8, "_torchao_installed", lambda: True)
    monkeypatch.setattr(fp8, "_torchao_version", lambda: "0.12.0")  # a release without these float8 internals
    with pytest.raises(ConfigError, match=r"^precision=fp8 needs torchao 0\.18\.0 .*found 0\.12\.0; install it") as err:
        _validated(cfg, 1)
    lines.append(str(err.value))
    monkeypatch.setattr(fp8, "_torchao_version", lambda: "0.18.1")  # a patch release of the pinned one: accepted
    fp8.check_fp8_installed(cfg.precision)
    with pytest.raises(ConfigError, match=r"precision.fp8_recipe") as err:
        _validated(compose(["model=tiny", "precision=fp8", "precision.fp8_recipe=blockwise"]), 1)
    lines.append(str(err.value))
    for key in ("fp8_recipe=rowwise", "fp8_emulate=true", "fp8_gemm_filter=none", "fp8_first_last_layers_bf16=1"):
        with pytest.raises(ConfigError) as err:
            _validated(compose(["model=tiny", "precision=bf16", f"precision.{key}"]), 1)
        value = key.split("=")[1].replace("true", "True")
        assert str(err.value) == (f"precision.{key.split('=')[0]}={value} applies only to precision=fp8 "
                                  "(this run: precision=bf16); set precision=fp8, or drop the key")
        lines.append(str(err.value))
    _validated(compose(["model=tiny", "precision=bf16", "precision.fp8_recipe=tensorwise"]), 1)  # the default: no-op
    assert all("\n" not in line and "precision" in line for line in lines), lines


def test_fp8_bench_suite_runs_both_sides_per_precision(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import configs as bc
    import run_bench

    cfgs = bc.suite("fp8", 1)
    assert [c.name for c in cfgs] == ["f_gpt1.3b_mb4x4", "f_8l_h4096_mb2x4"]
    jobs = run_bench.plan(cfgs[:1], suite_name="fp8", log_dir=tmp_path, python="python", trainers=("mptrain",))
    assert [(j["trainer"], j["variant"]) for j in jobs] == [
        ("mptrain", "compile"), ("mptrain", "compile_fp8"), ("mptrain", "compile_fp8_rowwise"),
        ("torch-reference", "compile_amp"), ("torch-reference", "compile_amp_fp8"),
        ("torch-reference", "compile_amp_fp8_rowwise")]
    rowwise = jobs[2]["argv"]
    assert rowwise.count("precision=fp8") == 1 and "precision=bf16" not in rowwise
    assert "precision.fp8_recipe=rowwise" in rowwise
    assert [bc.variant_precision(cfgs[0], j["variant"]) for j in jobs] == [
        "bf16", "fp8-tensorwise", "fp8-rowwise", "bf16", "fp8-tensorwise", "fp8-rowwise"]


def _fp8_saved_bytes_per_layer(rank, world, hidden_size=64, gemm_filter="none"):
    """Bytes one tensorwise-FP8 layer saves for backward per micro-batch (4 layers minus 2, halved),
    counted as tests/test_plan_activations.py counts them (unique storages, parameters excluded)."""
    from mptrain.config.model import ModelConfig
    from mptrain.config.parallel import ParallelConfig
    from mptrain.groups import build_groups
    from mptrain.layers.fp8 import Fp8Recipe, apply_fp8
    from mptrain.layers.gpt import build_model_chunks
    from mptrain.precision.module import Float16Module

    groups = build_groups(1, 1)
    try:
        total = {}
        for layers in (4, 2):
            m = ModelConfig(num_layers=layers, hidden_size=hidden_size, num_attention_heads=4, seq_length=32,
                            vocab_size=128)
            chunk = build_model_chunks(m, ParallelConfig(), groups, vocab_size=128)[0]
            apply_fp8([chunk], Fp8Recipe(emulate=True, gemm_filter=gemm_filter), num_layers=layers)
            model = Float16Module(chunk, torch.bfloat16, is_first_stage=True, is_last_stage=True)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            seen = {}

            def pack(t):
                if t.untyped_storage().data_ptr() not in params:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(ids, torch.arange(32).expand(2, 32), None, labels=ids)
            total[layers] = sum(seen.values())
        return (total[4] - total[2]) / 2
    finally:
        groups.destroy()


@pytest.mark.parametrize("hidden_size, gemm_filter", [
    (64, "none"),  # all four linears in FP8
    (272, "auto"),  # the size rule keeps QKV, proj and fc2 bf16 (fc1 [1088, 272]: out > 1024 is in FP8)
])
def test_planner_fp8_activation_bytes_match_measurement(hidden_size, gemm_filter):
    from mptrain.config.model import ModelConfig
    from mptrain.planner.config import PlanConfig
    from mptrain.planner.memory import PlanLayout, fp8_linears, layer_activation_bytes

    measured = run_distributed(_fp8_saved_bytes_per_layer, 1, hidden_size, gemm_filter)[0]
    cfg = PlanConfig()
    cfg.model = ModelConfig(num_layers=4, hidden_size=hidden_size, num_attention_heads=4, seq_length=32,
                            vocab_size=128)
    cfg.train.micro_batch_size = 2
    layout = PlanLayout(1, 1, None, 1, False, "none", False, "no_pipelining", 1)
    cfg.precision.name = "bf16"
    bf16 = layer_activation_bytes(cfg, layout)
    cfg.precision.name, cfg.precision.fp8_gemm_filter = "fp8", gemm_filter
    assert list(fp8_linears(cfg, 1)) == (["qkv", "proj", "fc1", "fc2"] if gemm_filter == "none" else ["fc1"])
    expected = layer_activation_bytes(cfg, layout)
    assert expected < bf16
    assert measured == pytest.approx(expected, rel=0.03), (measured, expected, bf16)  # as test_plan_activations


def test_planner_fp8_stage_activations_count_the_stage_own_bf16_layers():
    """8 layers on pp4 with fp8_first_last_layers_bf16=2: stages 0 and 3 hold only bf16 layers and plan
    bf16's activations; stages 1 and 2 only FP8 layers (the first stage holds the most micro-batches)."""
    from mptrain.config.model import ModelConfig
    from mptrain.planner.config import PlanConfig
    from mptrain.planner.memory import PlanLayout, inflight_microbatches, layer_activation_bytes, stage_activation_bytes
    from mptrain.planner.params import RankParams

    cfg = PlanConfig()
    cfg.model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
    layout = PlanLayout(1, 4, None, 1, False, "none", False, "1f1b", 8)
    cfg.precision.name = "bf16"
    bf16 = layer_activation_bytes(cfg, layout)
    cfg.precision.name, cfg.precision.fp8_gemm_filter = "fp8", "none"
    fp8 = layer_activation_bytes(cfg, layout)
    cfg.precision.fp8_first_last_layers_bf16 = 2
    assert fp8 < bf16 and layer_activation_bytes(cfg, layout) == pytest.approx((bf16 + fp8) / 2)  # the model's mix
    for stage, per_layer in enumerate((bf16, fp8, fp8, bf16)):
        rp = RankParams(numel=0, num_params=0, layers=(2 * stage, 2 * stage + 1), has_embedding=stage == 0,
                        has_output=stage == 3)
        inflight = inflight_microbatches("1f1b", pp=4, vpp=None, m=8, pp_rank=stage)
        assert stage_activation_bytes(cfg, layout, rp, pp_rank=stage) == pytest.approx(inflight * 2 * per_layer), stage
    # full recompute, one layer a group, a stage of layers 1 (bf16) and 2 (FP8): the recomputed peak is the bf16 layer's
    full = dataclasses.replace(layout, recompute="full")
    cfg.model.recompute_num_layers = 1
    rp = RankParams(numel=0, num_params=0, layers=(1, 2), has_embedding=False, has_output=False)
    saved = stage_activation_bytes(cfg, full, rp, pp_rank=1) - layer_activation_bytes(cfg, full, recompute="none",
                                                                                         layers=(1,))
    b = cfg.train.micro_batch_size
    assert saved == pytest.approx(3 * 2 * 2 * 32 * b * 64)  # 3 in flight x 2 groups x 2-byte inputs [s, b, h]


def _fp8_summaries(rank, world):
    from mptrain.config.model import ModelConfig
    from mptrain.config.parallel import ParallelConfig
    from mptrain.groups import build_groups
    from mptrain.layers.fp8 import Fp8Recipe, apply_fp8, gemm_runs_in_fp8
    from mptrain.layers.gpt import build_model_chunks

    groups = build_groups(1, 1)
    try:
        m = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
        out = {}
        warnings = {}
        for name, recipe in (("first_last_1", Fp8Recipe(emulate=True, gemm_filter="none", first_last_layers_bf16=1)),
                             # as ZeRO-2 / ZeRO-3 convert (`training.run.convert_to_fp8`): no cached weight casts
                             ("first_last_1_gathered", Fp8Recipe(emulate=True, gemm_filter="none",
                                                                 first_last_layers_bf16=1)),
                             ("auto_filter", Fp8Recipe(emulate=True)),
                             ("first_last_9", Fp8Recipe(emulate=True, gemm_filter="none", first_last_layers_bf16=9)),
                             ("auto_filter_ffn1040", Fp8Recipe(emulate=True)),
                             ("hidden_72", Fp8Recipe(emulate=True, gemm_filter="none")),
                             ("hidden_72_bf16_stage", Fp8Recipe(emulate=True, gemm_filter="none",
                                                                first_last_layers_bf16=4))):
            # ffn 1040: fc1 [1040, 64] passes the size rule (out > 1024), QKV, proj and fc2 do not;
            # hidden 72: every linear has a dim of 72, not a multiple of 16
            # hidden_72_bf16_stage: layers 0-3 of a 9-layer model on one pipeline stage, all four kept bf16
            shape = {"auto_filter_ffn1040": dataclasses.replace(m, ffn_hidden_size=1040),
                     "hidden_72": dataclasses.replace(m, hidden_size=72),
                     "hidden_72_bf16_stage": dataclasses.replace(m, hidden_size=72)}.get(name, m)
            chunk = build_model_chunks(shape, ParallelConfig(), groups, vocab_size=128)[0]
            s = apply_fp8([chunk], recipe, num_layers=9 if name == "hidden_72_bf16_stage" else 4,
                          cache_weight_casts=name != "first_last_1_gathered")
            fp8_on = sorted(n for n, mod in chunk.named_modules() if getattr(mod, "fp8", None) is not None)
            out[name] = (s.fp8, s.below_size_rule, s.bf16_layers, fp8_on, s.describe(), s.local_dims_not_16)
            out[f"{name}_cast_bytes"] = sum(c.data.nbytes + (0 if c.data_t is None else c.data_t.nbytes)
                                            for c in (getattr(mod, "fp8_weight_cast", None) for mod in chunk.modules())
                                            if c is not None)
            warnings[name] = s.warning()
        out["warnings"] = warnings
        # gpt_1.3b's GEMMs at tp1 (torchao's thresholds): tensorwise converts all four, rowwise only QKV and fc1
        shapes = {"qkv": (6144, 2048), "proj": (2048, 2048), "fc1": (8192, 2048), "fc2": (2048, 8192)}
        out["gpt_1.3b"] = {r: sorted(k for k, sh in shapes.items()
                                     if gemm_runs_in_fp8(Fp8Recipe(recipe=r), global_shape=sh, local_shape=sh))
                           for r in ("tensorwise", "rowwise")}
        return out
    finally:
        groups.destroy()


SHARD_WARNING = ("warning: precision=fp8: block linears whose weight dims after tensor parallelism are not multiples "
                 "of 16, as FP8 GEMMs need, compute in bf16 (the kernels: line counts them); make model.hidden_size and "
                 "model.ffn_hidden_size multiples of 16 x parallel.tensor_model_parallel_size (and the QKV width), or "
                 "use precision=bf16")


def test_fp8_first_last_layers_and_size_rule():
    from mptrain.config.model import ModelConfig
    from mptrain.planner.config import PlanConfig
    from mptrain.planner.memory import PlanLayout, fp8_weight_cast_bytes
    from mptrain.planner.params import RankParams

    out = run_distributed(_fp8_summaries, 1)[0]
    cfg = PlanConfig()  # the planner's weight-cast bytes against the casts allocated (emulated: no transposed copy)
    cfg.model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
    cfg.precision.name, cfg.precision.fp8_emulate, cfg.precision.fp8_gemm_filter = "fp8", True, "none"
    cfg.precision.fp8_first_last_layers_bf16 = 1
    rp = RankParams(numel=0, num_params=0, layers=(0, 1, 2, 3), has_embedding=True, has_output=True)
    layout = PlanLayout(1, 1, None, 1, False, "none", False, "no_pipelining", 1)
    assert out["first_last_1_cast_bytes"] == fp8_weight_cast_bytes(cfg, layout, rp) == 2 * 12 * 64 * 64
    cfg.precision.fp8_gemm_filter, cfg.precision.fp8_first_last_layers_bf16 = "auto", 0
    assert out["auto_filter_cast_bytes"] == fp8_weight_cast_bytes(cfg, layout, rp) == 0  # every GEMM below the rule
    cfg.model.ffn_hidden_size = 1040
    assert out["auto_filter_ffn1040_cast_bytes"] == fp8_weight_cast_bytes(cfg, layout, rp) == 4 * 1040 * 64
    assert out["auto_filter_ffn1040"][:2] == (4, 12)  # fc1 of each layer in FP8, the other 12 linears bf16
    fp8, below, bf16_layers, on, line, _ = out["first_last_1"]
    assert (fp8, below, bf16_layers) == (8, 0, [0, 3])
    assert {n.split(".")[2] for n in on} == {"1", "2"} and len(on) == 8  # decoder.layers.<n>.…
    assert "layers 0, 3 (precision.fp8_first_last_layers_bf16=1)" in line
    assert "emulated: 8 of 16 block linears (3 GEMMs each) in FP8" in line  # the bf16 layers' 8 counted in the total
    assert "in FP8 on this rank; weights cast to FP8 once per iteration; bf16:" in line
    # ZeRO-2 / ZeRO-3: the same linears in FP8, no cast held (each GEMM casts the weight FSDP gathered), none planned
    fp8, below, bf16_layers, gathered_on, line, _ = out["first_last_1_gathered"]
    assert (fp8, below, bf16_layers, gathered_on) == (8, 0, [0, 3], on)
    assert ("in FP8 on this rank; weights cast to FP8 in each GEMM after FSDP's per-layer all-gather (ZeRO-2 / ZeRO-3); "
            "bf16:") in line
    cfg.precision.fp8_gemm_filter, cfg.precision.fp8_first_last_layers_bf16 = "none", 1
    zero3 = PlanLayout(1, 1, None, 2, False, "none", False, "no_pipelining", 1, strategy="optim_grads_params")
    assert out["first_last_1_gathered_cast_bytes"] == fp8_weight_cast_bytes(cfg, zero3, rp) == 0
    fp8, below, _, on, line, _ = out["auto_filter"]
    assert (fp8, below, on) == (0, 16, [])  # h = 64: every GEMM below the thresholds
    assert "16 below the size rule (precision.fp8_gemm_filter=auto)" in line
    fp8, below, bf16_layers, on, line, _ = out["first_last_9"]
    assert (fp8, below, bf16_layers, on) == (0, 0, [0, 1, 2, 3], [])
    assert "emulated: 0 of 16 block linears (3 GEMMs each) in FP8" in line
    assert out["warnings"] == {
        "first_last_1": None, "first_last_1_gathered": None,
        "auto_filter": "warning: precision=fp8 with no FP8 GEMM: every block linear is below the size rule "
                       "(precision.fp8_gemm_filter=auto); set precision.fp8_gemm_filter=none, or use precision=bf16",
        "first_last_9": "warning: precision=fp8 with no FP8 GEMM: precision.fp8_first_last_layers_bf16=9 keeps all "
                        "4 layers bf16; set it to at most 1, or use precision=bf16",
        "auto_filter_ffn1040": None,
        "hidden_72": SHARD_WARNING, "hidden_72_bf16_stage": SHARD_WARNING}
    fp8, below, _, on, line, local = out["hidden_72"]
    assert (fp8, below, local, on) == (0, 0, 16, [])
    assert out["hidden_72_bf16_stage"][:3] == (0, 0, [0, 1, 2, 3]) and out["hidden_72_bf16_stage"][5] == 0
    assert "0 of 16 block linears (3 GEMMs each) in FP8" in line and "16 with weight dims on this rank not multiples of 16" in line
    assert out["gpt_1.3b"] == {"tensorwise": ["fc1", "fc2", "proj", "qkv"], "rowwise": ["fc1", "qkv"]}


def test_fp8_size_rule_decides_on_the_global_shape_then_the_tp_shard():
    from mptrain.layers.fp8 import BELOW_SIZE_RULE, IN_FP8, LOCAL_DIMS_NOT_16, Fp8Recipe, fp8_gemm_decision

    none, auto = Fp8Recipe(gemm_filter="none"), Fp8Recipe()
    # hidden 48: QKV [144, 48] is FP8 at tp1; at tp2 its shard [72, 48] is not a multiple of 16
    assert fp8_gemm_decision(none, global_shape=(144, 48), local_shape=(144, 48)) == IN_FP8
    assert fp8_gemm_decision(none, global_shape=(144, 48), local_shape=(72, 48)) == LOCAL_DIMS_NOT_16
    # the size rule first: a small GEMM is below it whatever its shard (hidden 72: not a multiple of 16 either)
    assert fp8_gemm_decision(auto, global_shape=(216, 72), local_shape=(216, 72)) == BELOW_SIZE_RULE
    # the thresholds read the global shape: a tp8 shard of gpt_1.3b's fc2 [2048, 8192 / 8] stays in FP8
    assert fp8_gemm_decision(auto, global_shape=(2048, 8192), local_shape=(2048, 1024)) == IN_FP8
    assert fp8_gemm_decision(auto, global_shape=(1024, 4096), local_shape=(512, 4096)) == BELOW_SIZE_RULE


def test_fp8_with_no_fp8_gemm_warns_in_the_train_log(tmp_path):
    run_distributed(run_job, 1, ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16",
                                 "train.train_iters=1", "train.global_batch_size=2", "train.micro_batch_size=2",
                                 "train.eval_interval=null", "precision=fp8", "precision.fp8_emulate=true",
                                 "precision.fp8_first_last_layers_bf16=9", f"run.dir={tmp_path}"])
    log = (tmp_path / "train.log").read_text()
    assert "precision=fp8 (tensorwise, emulated: 0 of 8 block linears (3 GEMMs each) in FP8" in log
    warnings = [line for line in log.splitlines() if "warning: precision=fp8" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "warning: precision=fp8 with no FP8 GEMM: precision.fp8_first_last_layers_bf16=9 keeps all 2 layers bf16; "
        "set it to at most 0, or use precision=bf16"), warnings


# --- on an FP8 GPU (marker gpu; skipped elsewhere) ----------------------------------------------
GPU_COMMON = ["model=tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
              "model.seq_length=128", "train.global_batch_size=8", "train.micro_batch_size=4", "train.train_iters=20",
              "train.eval_interval=null", "model.compile_layers=true", "run.progress_bar=false"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gpu_fp8_compiled_chunk_tracks_bf16(tmp_path, recipe):
    """precision=fp8 with torch._scaled_mm inside the compiled chunk graph (CUDA graphs at tp1): the loss
    curve follows bf16's (FP8 rounding: within 2 % per step over 20 steps of a 4-layer model), every
    block linear runs in FP8, and eager FP8 (no compile) follows the compiled run within the same 2 %: Inductor
    keeps a fused producer's output (gelu, a norm) in fp32 up to the FP8 cast where eager rounds it to bf16
    first, so elements on an FP8 rounding boundary land one FP8 step (6-12 %) apart, as they do for torchao's
    own Float8Linear (`test_gpu_fp8_compiled_mlp_equals_torchao_compiled`)."""
    import torch.distributed as dist

    from mptrain.training.run import run

    def job(name, overrides):
        run(compose(GPU_COMMON + overrides + [f"run.dir={tmp_path / name}"]))
        if dist.is_initialized():
            dist.destroy_process_group()
        return read_rows(tmp_path / name), (tmp_path / name / "train.log").read_text()

    fp8_keys = ["precision=fp8", f"precision.fp8_recipe={recipe}", "precision.fp8_gemm_filter=none"]
    bf16, _ = job("bf16", ["precision=bf16"])
    fp8, log = job("fp8", fp8_keys)
    eager, _ = job("fp8_eager", fp8_keys + ["model.compile_layers=false"])
    assert f"precision=fp8 ({recipe}: 16 of 16 block linears" in log and "compile=chunk" in log, log
    for a, b, c in zip(fp8, bf16, eager):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=2e-2), (a, b)
        assert a["lm_loss"] == pytest.approx(c["lm_loss"], rel=2e-2), (a, c)
    assert fp8[-1]["lm_loss"] < fp8[0]["lm_loss"]  # training moved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gpu_fp8_compiled_mlp_equals_torchao_compiled(recipe):
    """fc1 -> gelu -> fc2 in FP8 under Inductor: mptrain's parallel linears equal torchao's Float8Linear
    compiled the same way, bit for bit (output, input grad, weight grads; tensorwise fc2's weight grad: the
    reused forward cast, see below), on real FP8 GEMMs. Eager, the two are bitwise equal for every recipe
    (`test_fp8_linears_equal_torchao_and_tp2_and_cp2_equal_tp1`); compiled, each differs from its own eager result
    (the fused gelu stays fp32 up to the FP8 cast). Tensorwise with the weight casts made once
    (`Fp8WeightCasts.cached`, its compiled refresh and the transposed copy the grad-input GEMM reads) equals
    casting in each GEMM, bit for bit."""
    import contextlib

    import torch.distributed as dist
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from mptrain.layers.context import LayerContext
    from mptrain.layers.fp8 import IN_FP8, Fp8Recipe, Fp8WeightCasts
    from mptrain.layers.linear import ColumnParallelLinear, RowParallelLinear
    from mptrain.layers.random import ParamInit
    from mptrain.groups import build_groups

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    g = build_groups(1, 1, device=torch.device("cuda"))
    try:
        cuda = torch.device("cuda")
        ctx = LayerContext(groups=g, init=ParamInit(seed=5, std=0.05, num_layers=2, device=cuda),
                           params_dtype=torch.bfloat16, device=cuda)
        fc1 = ColumnParallelLinear(256, 1024, context=ctx, name="fc1", bias=False)
        fc2 = RowParallelLinear(1024, 256, context=ctx, name="fc2", bias=False)
        on = Fp8Recipe(recipe=recipe, gemm_filter="none")
        assert fc1.enable_fp8(on) == fc2.enable_fp8(on) == IN_FP8
        config = Float8LinearConfig.from_recipe_name(recipe)

        def torchao_linear(m):
            lin = torch.nn.Linear(m.weight.shape[1], m.weight.shape[0], bias=False, device=cuda, dtype=torch.bfloat16)
            lin.weight.data.copy_(m.weight.data)
            return Float8Linear.from_float(lin, config=config)

        r1, r2 = torchao_linear(fc1), torchao_linear(fc2)
        gen = torch.Generator(device=cuda).manual_seed(3)
        x = torch.randn(128, 4, 256, generator=gen, device=cuda).to(torch.bfloat16)
        dy = torch.randn(128, 4, 256, generator=gen, device=cuda).to(torch.bfloat16)
        results = []
        mlp = lambda t: fc2(torch.nn.functional.gelu(fc1(t)[0]))[0]  # noqa: E731
        runs = [(mlp, (fc1, fc2), contextlib.nullcontext()),
                (lambda t: r2(torch.nn.functional.gelu(r1(t))), (r1, r2), contextlib.nullcontext())]
        if recipe == "tensorwise":
            runs.append((mlp, (fc1, fc2), Fp8WeightCasts([fc1, fc2]).cached()))
        for f, lins, casts in runs:
            torch._dynamo.reset()
            for lin in lins:
                lin.weight.grad = None
            xi = x.clone().requires_grad_(True)
            with casts:
                y = torch.compile(f)(xi)
                y.backward(dy)
            results.append((y.detach(), xi.grad, lins[0].weight.grad, lins[1].weight.grad))
        ours, theirs, *cached = results
        for c in cached:
            assert all(torch.equal(a, b) for a, b in zip(c, ours))
        for a, b in zip(ours[:3], theirs[:3]):  # output, input grad, fc1's weight grad
            assert torch.equal(a, b)
        if recipe == "tensorwise":
            # fc2's weight grad: mptrain reuses the forward's FP8 cast of gelu's fp32 output; torchao recasts the
            # bf16 copy it saved, so boundary elements sit one FP8 step apart (on CPU, emulated: 1.7 % norm-wise)
            assert float((ours[3] - theirs[3]).float().norm() / theirs[3].float().norm()) < 5e-2
        else:
            assert torch.equal(ours[3], theirs[3])
    finally:
        g.destroy()


def test_importing_torchao_for_fp8_prints_nothing():
    # a fresh interpreter: torchao logs once per process, at its first import (here: the first FP8 cast's lookup)
    import subprocess
    import sys

    pytest.importorskip("torchao")
    code = "from mptrain.layers import fp8_torchao; fp8_torchao.load('tensorwise', True)"  # all of torchao used
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (out.stdout, out.stderr) == ("", "")
