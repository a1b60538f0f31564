#!/usr/bin/env python3
"""One MLP block (LayerNorm, fc1, GeLU, fc2, residual) forward and backward on one GPU, compiled, through
mptrain's own linear (`mptrain.layers.linear.linear`) in bf16 and in FP8 (tensorwise, weight casts cached,
weight grads added into fp32 ``main_grad``), under several Inductor option sets.

    PYTHONPATH=src:bench python bench/fp8_mlp_kernels.py [--tokens 8192 --hidden 2048 --ffn 8192] [--profile]

One JSON row per variant: milliseconds per forward-backward (CUDA events, median of 5 passes of ``--iters``),
and whether its ``main_grad``s after one step equal the first FP8 variant's bitwise. ``--profile``: also the
top kernels of each variant by device time (a text table on stderr). The FP8 variants: as the trainer runs
(dy's amax taken beside the bias grad, `Fp8Gemms.cast_grad_output`), with dy's amax over the whole tensor,
and with Inductor's ``prefer_nd_tiling`` (how a kernel writing an FP8 tensor and its transposed copy tiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from mptrain.layers import fp8 as fp8_mod
from mptrain.layers.linear import linear

VARIANTS = {  # name: (FP8, Inductor options, dy's amax beside the bias grad: cast_grad_output's with_bias_grad)
    "bf16": (False, {}, None),
    "bf16_nd_tiling": (False, {"triton.prefer_nd_tiling": True}, None),
    "bf16_tiled_reductions": (False, {"triton.prefer_nd_tiling": True, "triton.tile_reductions": True}, None),
    "bf16_cooperative": (False, {"triton.cooperative_reductions": True}, None),
    "fp8": (True, {}, True),
    "fp8_whole_tensor_amax": (True, {}, False),
    "fp8_nd_tiling": (True, {"triton.prefer_nd_tiling": True}, True),
}


class _Linear:
    """What `Fp8WeightCasts` reads of a linear: ``weight``, ``fp8``, ``fp8_weight_cast``."""

    def __init__(self, out_f: int, in_f: int, gemms) -> None:
        self.weight = (torch.randn(out_f, in_f, device="cuda") * in_f ** -0.5).bfloat16().requires_grad_()
        self.bias = torch.zeros(out_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        self.main_grad = torch.zeros(out_f, in_f, device="cuda")
        self.fp8 = gemms
        self.fp8_weight_cast = fp8_mod.Fp8WeightCast.for_linear(gemms, self.weight) if gemms else None


class _WholeTensorAmax(fp8_mod.Fp8Gemms):
    """dy's amax over the whole tensor whatever the caller says (the cast before ``with_bias_grad``)."""

    def cast_grad_output(self, grad_output, *, with_bias_grad=False):
        return super().cast_grad_output(grad_output, with_bias_grad=False)


def build(use_fp8: bool, column_amax, tokens: int, hidden: int, ffn: int):
    torch.manual_seed(0)
    gemms = None
    if use_fp8:
        cls = fp8_mod.Fp8Gemms if column_amax else _WholeTensorAmax
        gemms = cls(fp8_mod.Fp8Recipe(), amax_group=None, input_sharded=False, output_sharded=False)
    fc1, fc2 = _Linear(ffn, hidden, gemms), _Linear(hidden, ffn, gemms)
    ln_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ln_b = torch.zeros(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    casts = fp8_mod.Fp8WeightCasts([fc1, fc2]) if use_fp8 else None

    def block(x):
        xn = F.layer_norm(x, (hidden,), ln_w, ln_b)
        y1 = linear(xn, fc1.weight, fc1.bias, fc1.main_grad, gemms, fc1.fp8_weight_cast)
        y2 = linear(F.gelu(y1), fc2.weight, fc2.bias, fc2.main_grad, gemms, fc2.fp8_weight_cast)
        return y2 + x

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    return block, x, dy, casts, (fc1, fc2)


def run_variant(name: str, args) -> tuple:
    use_fp8, options, column_amax = VARIANTS[name]
    torch._dynamo.reset()
    block, x, dy, casts, linears = build(use_fp8, column_amax, args.tokens, args.hidden, args.ffn)
    compiled = torch.compile(block, options=options, dynamic=False)
    ctx = casts.cached() if casts is not None else None
    if ctx is not None:
        ctx.__enter__()

    def step():
        compiled(x).backward(dy)

    step()
    first = [m.main_grad.clone() for m in linears]
    for _ in range(3):
        step()
    passes = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            step()
        end.record()
        torch.cuda.synchronize()
        passes.append(start.elapsed_time(end) / args.iters)
    table = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=90)
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return statistics.median(passes), first, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    # what apply_fp8 applies before any float8 kernel is compiled (`mptrain.layers.fp8.apply_fp8`)
    from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen
    _patch_inductor_min_max_codegen()
    reference = None
    for name in a.variants.split(","):
        ms, grads, table = run_variant(name, a)
        same = None
        if VARIANTS[name][0]:  # the first FP8 variant is the reference
            reference = reference or grads
            same = all(torch.equal(g, r) for g, r in zip(grads, reference))
        print(json.dumps({"variant": name, "options": VARIANTS[name][1], "ms_per_fwd_bwd": round(ms, 3),
                          "column_amax": VARIANTS[name][2], "main_grad_equal_first_fp8": same, "tokens": a.tokens, "hidden": a.hidden,
                          "ffn": a.ffn, "gpu": torch.cuda.get_device_name()}), flush=True)
        if table:
            print(f"== {name}\n{table}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
