"""How much of an MoE layer's time is routing and permutation, not the experts' GEMMs (one GPU).

    python bench/moe_share.py [--tokens 8192] [--hidden 1024] [--ffn 3584] [--experts 8] [--topk 2] [--reps 20]
                              [--device cuda]

Builds mptrain's `mptrain.layers.moe.MoELayer` (bf16, router in fp32, aux loss 0.01, dropless, ep 1: the
``moe_mixtral_small`` layer at one micro-batch of 4 × 2048 tokens by default) and times, compiled as the trainer
compiles it (``torch.compile``, the layer inside the graph), the median forward + backward of

* the whole layer (router, aux loss, permutation, grouped-GEMM experts, unpermutation);
* the experts alone on the same permuted rows (both grouped GEMMs, SwiGLU, the routing weight).

routing + permutation = layer − experts. Then one eager forward + backward under ``torch.profiler``: the device
time of the kernels launched inside the layer's ``record_function`` regions (``moe.router``, ``moe.permute``,
``moe.experts``, ``moe.unpermute``; forward only: backward kernels belong to no region) as a second view.
Prints one JSON line; `bench/run_bench.py` (suite ``moe``) divides ``routing_ms`` × layers × micro-batches by the
measured step of the same call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mptrain.config.model import ModelConfig
from mptrain.layers.context import LayerContext
from mptrain.layers.moe import MoELayer
from mptrain.layers.random import ParamInit

REGIONS = ("moe.router", "moe.permute", "moe.experts", "moe.unpermute")


def build(args) -> MoELayer:
    from mptrain.checkpoint.offline import single_rank_groups

    cfg = ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8, num_moe_experts=args.experts,
                      moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn, add_bias_linear=False, activation="swiglu",
                      moe_aux_loss_coeff=0.01, moe_router_dtype="fp32")
    device = torch.device(args.device)
    ctx = LayerContext(groups=single_rank_groups(), init=ParamInit(seed=1, std=0.02, num_layers=1, device=device),
                       device=device)
    return MoELayer(cfg, ctx, layer_number=0).to(torch.bfloat16)


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def region_ms(layer, x, g) -> dict:
    """Device ms of the kernels launched in each region of one eager forward (+ the backward's total)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])) as prof:
        layer._eager_forward(x).backward(g)
        _sync()
    out = {}
    for e in prof.key_averages():
        if e.key in REGIONS:
            us = getattr(e, "device_time_total", None)
            out[e.key] = round((e.cuda_time_total if us is None else us) / 1e3, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script, not a measurement")
    args = p.parse_args()
    layer = build(args).train()
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(args.tokens, 1, args.hidden, device=args.device, generator=gen).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(x.shape, device=args.device, generator=gen).to(torch.bfloat16)
    with torch.no_grad():  # the permuted rows the experts see (a real routing of x)
        probs, routing_map = layer.router(x)
        rows, tokens_per_expert, row_probs = layer.token_dispatcher.dispatch(x.reshape(-1, args.hidden), probs,
                                                                          routing_map)
        layer.token_dispatcher.combine(rows)  # drops the dispatcher's state
    rows = rows.detach().requires_grad_(True)
    grows = torch.randn(rows.shape, device=args.device, generator=gen).to(torch.bfloat16)
    whole = torch.compile(layer._forward)
    experts = torch.compile(layer.experts.forward)
    layer_ms = median_ms(lambda: whole(x).backward(g), args.reps)
    experts_ms = median_ms(lambda: experts(rows, tokens_per_expert, row_probs).backward(grows), args.reps)
    routing = layer_ms - experts_ms
    print(json.dumps({"name": "moe_share", "layer_ms": round(layer_ms, 4), "experts_ms": round(experts_ms, 4),
                      "routing_ms": round(routing, 4), "routing_share_of_layer": round(routing / layer_ms, 4),
                      "eager_forward_region_ms": region_ms(layer, x, g), "kernel": layer.experts.kernel()[0],
                      "shape": {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
                                "experts": args.experts, "topk": args.topk},
                      "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
