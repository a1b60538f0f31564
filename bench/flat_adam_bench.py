"""The optimizer step at a model's param shapes: torch's fused AdamW + the bf16 model-param copy against the
flat step (`mptrain.precision.flat_adam`), both through `MixedPrecisionOptimizer.launch_step` (norm, skip
decision, update, model params), grads in one DDP-like fp32 buffer. Prints one JSON row per arm and one
exactness row (the two arms from the same start over ``--check-steps`` steps on the same grads).

    python3 bench/flat_adam_bench.py --model gpt_1.3b --out rows.jsonl      # GPU
    python3 bench/flat_adam_bench.py --model tiny --device cpu             # a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import types

import torch

from mptrain.config.optim import OptimConfig
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import build_optimizer_factory
from mptrain.precision import MixedPrecisionOptimizer

SHAPES = {"gpt_1.3b": (24, 2048, 50304, 2048), "gpt_124m": (12, 768, 50304, 1024), "gpt_11m": (6, 384, 50304, 256),
          "tiny": (2, 16, 64, 8)}


def param_shapes(model: str) -> list:
    """(shape, no_weight_decay) of every param of a GPT (learned positions, untied output = tied: one)."""
    layers, h, vocab, seq = SHAPES[model]
    out = [((vocab, h), False), ((seq, h), False)]
    for _ in range(layers):
        out += [((h,), True), ((h,), True), ((3 * h, h), False), ((3 * h,), True), ((h, h), False), ((h,), True),
                ((h,), True), ((h,), True), ((4 * h, h), False), ((4 * h,), True), ((h, 4 * h), False), ((h,), True)]
    return out + [((h,), True), ((h,), True)]


def build(model: str, device: torch.device, flat: bool, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = param_shapes(model)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen, device=device) * 0.02).to(torch.bfloat16))
              for s, _ in shapes]
    specs = [ShardSpec(s, no_weight_decay=nd) for s, nd in shapes]
    buf = torch.zeros(sum(p.numel() for p in params), device=device)
    views, off = {}, 0
    for p in reversed(params):  # buffer order = reverse registration order, as GradBuffer
        views[p] = buf[off:off + p.numel()].view(p.shape)
        off += p.numel()
    factory = build_optimizer_factory(OptimConfig(_target_="torch.optim.AdamW", lr=3e-4, weight_decay=0.1))
    groups = types.SimpleNamespace(mp_group=None, tp_rank=0, device=device)
    opt = MixedPrecisionOptimizer(factory, params, specs, lambda p: views[p], groups, scaler=None, clip_grad=1.0,
                                  max_consecutive_skips=0, flat_adam_step=flat)
    return opt, params, buf


def fill_grads(buf: torch.Tensor, step: int) -> None:
    gen = torch.Generator(device=buf.device).manual_seed(1000 + step)
    buf.copy_(torch.randn(buf.shape, generator=gen, device=buf.device) * 1e-3)


def time_steps(opt, buf, iters: int, warmup: int) -> list:
    times = []
    for i in range(warmup + iters):
        fill_grads(buf, i)
        if buf.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            pending = opt.launch_step()
            end.record()
            pending.result()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
        else:
            opt.launch_step().result()
    return times


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in fp32 units in the last place between two fp32 tensors of like signs."""
    ia, ib = a.contiguous().view(torch.int32).long(), b.contiguous().view(torch.int32).long()
    return int((ia - ib).abs().max().item()) if a.numel() else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_1.3b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    arms = {}
    for flat in (False, True):
        opt, params, buf = build(args.model, device, flat)
        for step in range(args.check_steps):  # the exactness run, from the shared start
            fill_grads(buf, 100 + step)
            opt.launch_step().result()
        arms[flat] = ([e.main.detach().clone() for e in opt.entries], [p.detach().clone() for p in params],
                      [opt.optimizer.state[e.main]["exp_avg_sq"].clone() for e in opt.entries])
        times = time_steps(opt, buf, args.iters, args.warmup)
        n = sum(p.numel() for p in params)
        row = {"bench": "flat_adam", "model": args.model, "params": n, "arm": "flat" if flat else "torch_fused+copy",
               "note": opt.flat_step_note, "ms_median": statistics.median(times) if times else None,
               "ms_min": min(times) if times else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del opt, params, buf
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (m0, p0, v0), (m1, p1, v1) = arms[False], arms[True]
    row = {"bench": "flat_adam_exactness", "model": args.model, "steps": args.check_steps,
           "main_bitwise": all(torch.equal(a, b) for a, b in zip(m0, m1)),
           "main_max_ulps": max(ulps(a, b) for a, b in zip(m0, m1)),
           "main_elements_differing": sum(int((a != b).sum()) for a, b in zip(m0, m1)),
           "main_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(m0, m1)),
           "model_bitwise": all(torch.equal(a, b) for a, b in zip(p0, p1)),
           "exp_avg_sq_max_ulps": max(ulps(a, b) for a, b in zip(v0, v1)),
           "model_is_rounded_main": all(torch.equal(p.float(), m.to(torch.bfloat16).float()) for p, m in zip(p1, m1))}
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
