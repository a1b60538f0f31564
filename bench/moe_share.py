"""How much of an MoE layer's time is routing and permutation, not the experts' GEMMs (one GPU).

    python bench/moe_share.py [--tokens 8192] [--hidden 1024] [--ffn 3584] [--experts 8] [--topk 2] [--reps 20]
                              [--compile-mode auto] [--profile [--top 30]] [--device cuda]

Builds mptrain's `mptrain.layers.moe.MoELayer` (bf16, router in fp32, aux loss 0.01, dropless, ep 1: the
``moe_mixtral_small`` layer at one micro-batch of 4 × 2048 tokens by default) and times, compiled as the trainer
compiles it, the median forward + backward of

* the whole layer (router, aux loss, permutation, grouped-GEMM experts, unpermutation);
* the experts alone on the same permuted rows (both grouped GEMMs, SwiGLU, the routing weight).

routing + permutation = layer − experts. Both are compiled with the trainer's mode: ``--compile-mode auto`` is
``model.compile_mode=auto`` resolved as for a chunk graph at tp = pp = 1 (`mptrain.layers.compile.compile_mode_for`:
``reduce-overhead``, CUDA graphs, on CUDA; Inductor's default elsewhere), with the trainer's Inductor choices on
CUDA. Under CUDA graphs a replay reuses the previous replay's output memory, so every timed call starts a new
step (``torch.compiler.cudagraph_mark_step_begin``) and drops the previous grads first. Without CUDA graphs
(``--compile-mode default``) each small kernel of the routing also pays its launch on the host, which the
trainer's default command does not. The inputs keep their addresses (no copy into the graphs); the incoming
grads of the two backwards are copied in (``T·h`` elements for the layer, ``T·k·h`` for the experts), where the
trainer's graph receives them in place, so ``routing_ms`` is low by one ``T·(k−1)·h`` copy.

Then one eager forward + backward under ``torch.profiler``: the device time of the kernels launched inside the
layer's ``record_function`` regions (``moe.router``, ``moe.permute``, ``moe.experts``, ``moe.unpermute``; forward
only: backward kernels belong to no region) as a second view. ``--profile`` adds one profiled compiled forward +
backward of the layer and of the experts alone: the number of device kernels, their device time and the
``--top`` kernels by device time (on CPU, the ops by self CPU time: a smoke run of the option).
Prints one JSON line (last); `bench/run_bench.py` (suite ``moe``) divides ``routing_ms`` × layers ×
micro-batches by the measured step of the same call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Optional

import torch

from mptrain.config.model import ModelConfig
from mptrain.layers.context import LayerContext
from mptrain.layers.moe import MoELayer
from mptrain.layers.random import ParamInit

REGIONS = ("moe.router", "moe.permute", "moe.experts", "moe.unpermute")
MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def model_config(args) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=8, num_moe_experts=args.experts,
                       moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn, add_bias_linear=False,
                       activation="swiglu", moe_aux_loss_coeff=0.01, moe_router_dtype="fp32",
                       compile_mode=None if args.compile_mode == "default" else args.compile_mode)


def build(cfg: ModelConfig, device: torch.device) -> MoELayer:
    from mptrain.checkpoint.offline import single_rank_groups

    ctx = LayerContext(groups=single_rank_groups(), init=ParamInit(seed=1, std=0.02, num_layers=1, device=device),
                       device=device)
    return MoELayer(cfg, ctx, layer_number=0).to(torch.bfloat16)


def resolve_mode(cfg: ModelConfig, device: torch.device) -> Optional[str]:
    """The trainer's ``torch.compile`` mode for one chunk graph at tp = pp = 1; CUDA graphs only on CUDA (elsewhere
    ``reduce-overhead`` is Inductor's default and ``max-autotune`` its no-cudagraphs variant)."""
    from mptrain.checkpoint.offline import single_rank_groups
    from mptrain.layers.compile import compile_mode_for

    mode = compile_mode_for(cfg, single_rank_groups(), device, chunk=True)
    if device.type != "cuda":
        return {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
    return mode


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], None], reps: int) -> float:
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


def fwd_bwd(compiled: Callable, inputs: tuple, grad: torch.Tensor, leaves: list) -> Callable[[], None]:
    """One compiled forward + backward as a training step runs it: a new CUDA-graph step (a replay overwrites the
    previous one's outputs: nothing of it is kept), the grads of ``leaves`` (the inputs and parameters) dropped
    first, so each step's grads are its own."""

    def run() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        for t in leaves:
            t.grad = None
        compiled(*inputs).backward(grad)

    return run


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


def kernel_profile(run: Callable[[], None], device: torch.device, top: int) -> dict:
    """One profiled ``run`` (already compiled and warm): device kernels (CUDA: kernels, memcpy, memset; CPU: the
    ops by self time), their count, total ms and the ``top`` by time as ``[name, calls, us]``."""
    from torch.profiler import ProfilerActivity, profile

    from profile_report import is_kernel  # bench/ is the script's folder, on sys.path

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        _sync()
    rows = []
    for e in prof.key_averages():
        if cuda and not is_kernel(e):  # kernels and copies only: a user annotation spans kernels (double count)
            continue
        rows.append((float(e.self_device_time_total if cuda else e.self_cpu_time_total), int(e.count), e.key))
    rows.sort(reverse=True)
    return {"kernels": sum(r[1] for r in rows), "device_ms": round(sum(r[0] for r in rows) / 1e3, 4),
            "top": [[name[:160], calls, round(us, 1)] for us, calls, name in rows[:top]]}


def print_profile(name: str, prof: dict) -> None:
    """The profile as text lines (never starting with ``{``: `bench/run_bench.py` reads the JSON lines)."""
    print(f"== {name}: {prof['kernels']} kernels, {prof['device_ms']} ms device time; top by time:")
    for kernel, calls, us in prof["top"]:
        print(f"   {us:10.1f} us {calls:4d}x  {kernel[:110]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--compile-mode", default="auto", choices=MODES,
                   help="auto: the trainer's (model.compile_mode=auto: reduce-overhead on CUDA); default: Inductor's")
    p.add_argument("--profile", action="store_true", help="profile one compiled forward + backward (device kernels)")
    p.add_argument("--top", type=int, default=30, help="kernels listed by --profile")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script, not a measurement")
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = model_config(args)
    layer = build(cfg, device).train()
    mode = resolve_mode(cfg, device)
    if device.type == "cuda":  # the trainer's Inductor heuristics (`mptrain.layers.compile.apply_compile`)
        from mptrain.layers import inductor_choices

        inductor_choices.install()
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, generator=gen).to(torch.bfloat16).requires_grad_(True)
    g = torch.randn(x.shape, device=device, generator=gen).to(torch.bfloat16)
    with torch.no_grad():  # the permuted rows the experts see (a real routing of x)
        probs, routing_map = layer.router(x)
        rows, tokens_per_expert, row_probs = layer.token_dispatcher.dispatch(x.reshape(-1, args.hidden), probs,
                                                                          routing_map)
        layer.token_dispatcher.combine(rows)  # drops the dispatcher's state
    rows = rows.detach().requires_grad_(True)
    grows = torch.randn(rows.shape, device=device, generator=gen).to(torch.bfloat16)
    for t in (x, rows, tokens_per_expert, row_probs):  # fixed addresses: CUDA graphs replay on them without a copy
        torch._dynamo.mark_static_address(t)
    whole = fwd_bwd(torch.compile(layer._forward, mode=mode), (x,), g, [x, *layer.parameters()])
    experts = fwd_bwd(torch.compile(layer.experts.forward, mode=mode), (rows, tokens_per_expert, row_probs), grows,
                      [rows, *layer.experts.parameters()])
    layer_ms = median_ms(whole, args.reps)
    experts_ms = median_ms(experts, args.reps)
    routing = layer_ms - experts_ms
    result = {"name": "moe_share", "layer_ms": round(layer_ms, 4), "experts_ms": round(experts_ms, 4),
              "routing_ms": round(routing, 4), "routing_share_of_layer": round(routing / layer_ms, 4),
              "compile_mode": mode or "default"}
    if args.profile:
        profiles = {"layer": kernel_profile(whole, device, args.top), "experts": kernel_profile(experts, device, args.top)}
        for name, prof in profiles.items():
            print_profile(name, prof)
        result["profile"] = profiles
        result["routing_device_ms"] = round(profiles["layer"]["device_ms"] - profiles["experts"]["device_ms"], 4)
    from torch._dynamo.utils import counters

    torch.compiler.cudagraph_mark_step_begin()  # the eager pass below owns its grads
    for t in (x, *layer.parameters()):
        t.grad = None
    result.update({"cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
                   "eager_forward_region_ms": region_ms(layer, x, g), "kernel": layer.experts.kernel()[0],
                   "shape": {"tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts,
                             "topk": args.topk},
                   "torch": torch.__version__})
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
