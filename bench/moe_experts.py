"""One MoE layer on one device: the grouped-GEMM experts against the per-expert loop (values and time).

    python bench/moe_experts.py [--device cuda] [--dtype bf16] [--tokens 8192] [--hidden 1024] [--ffn 3584]
                                [--experts 8] [--topk 2]

Prints, per kernel (`mptrain.layers.moe.experts.GroupedMLP`: ``torch._grouped_mm`` or one GEMM per expert),
the kernel the layer chose and why, the relative difference of output and input grad to the loop's
(‖a − b‖ / ‖b‖), and the median forward + backward time of the whole layer (router, dispatch, experts,
combine) with its TFLOP/s over the routed experts' GEMMs (6 · T · k · 3 · h · f for SwiGLU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mptrain.config.model import ModelConfig
from mptrain.layers.context import LayerContext
from mptrain.layers.moe import MoELayer


def _groups():
    from mptrain.checkpoint.offline import single_rank_groups

    return single_rank_groups()


def build(args, grouped: bool) -> MoELayer:
    cfg = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8, num_moe_experts=args.experts,
                      moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn, add_bias_linear=False, activation="swiglu",
                      moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.01, moe_router_dtype="fp32")
    from mptrain.layers.random import ParamInit

    device = torch.device(args.device)
    ctx = LayerContext(groups=_groups(), init=ParamInit(seed=1, std=0.02, num_layers=1, device=device), device=device)
    return MoELayer(cfg, ctx, layer_number=0).to(args.dtype)


def step(layer, x, g):
    out = layer(x)
    out.backward(g)
    return out


def timed(layer, x, g, reps: int) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(3):
        step(layer, x, g)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        step(layer, x, g)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(args.tokens, 1, args.hidden, device=args.device, generator=gen).to(args.dtype)
    g = torch.randn(x.shape, device=args.device, generator=gen).to(args.dtype)
    layers = {"grouped": build(args, True), "loop": build(args, False)}
    results = {}
    for name, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        out = step(layer, xi, g)
        results[name] = (out.detach().float(), xi.grad.float())
    flops = 6 * args.tokens * args.topk * 3 * args.hidden * args.ffn
    print(f"device {args.device} ({torch.cuda.get_device_name() if x.is_cuda else 'cpu'}) dtype {args.dtype} "
          f"T {args.tokens} h {args.hidden} f {args.ffn} E {args.experts} k {args.topk}")
    for name, layer in layers.items():
        kind, why = layer.experts.kernel(args.dtype)
        rel = [float((a - b).norm() / b.norm()) for a, b in zip(results[name], results["loop"])]
        seconds = timed(layer, x.clone().requires_grad_(True), g, args.reps)
        print(f"{name:8s} kernel={kind}{f' ({why})' if why else ''} | rel diff to loop: out {rel[0]:.2e} "
              f"dx {rel[1]:.2e} | fwd+bwd {seconds * 1e3:.2f} ms | {flops / seconds / 1e12:.1f} TFLOP/s (experts)")


if __name__ == "__main__":
    main()
