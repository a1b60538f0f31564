"""Probe (GPU): cost of accumulating a weight grad into an fp32 main_grad, per micro-batch.

    python bench/scripts/wgrad_accum_probe.py            # prints one JSON line per case

For gpt_1.3b's weight shapes (tokens per micro-batch 4 × 2048) in bf16 with fp32 main grads:
(a) wgrad GEMM in bf16, then ``main_grad.add_(wgrad)`` (what the DDP hook does);
(b) the same add through a torch.compile'd kernel;
(c) one GEMM accumulating into main_grad: ``aten::addmm.dtype_out`` (bf16 × bf16 -> fp32, beta 1),
    Megatron's ``gradient_accumulation_fusion`` without apex. Times in ms (CUDA events, mean of 20).
"""

from __future__ import annotations

import json

import torch


def timed(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    dev, tokens, h = "cuda", 4 * 2048, 2048
    add_compiled = torch.compile(lambda m, g: m.add_(g), dynamic=True)
    for name, (out_f, in_f) in {"qkv": (3 * h, h), "proj": (h, h), "fc1": (4 * h, h), "fc2": (h, 4 * h)}.items():
        go = torch.randn(tokens, out_f, device=dev, dtype=torch.bfloat16)
        x = torch.randn(tokens, in_f, device=dev, dtype=torch.bfloat16)
        main_grad = torch.zeros(out_f, in_f, device=dev, dtype=torch.float32)
        gemm_only = timed(lambda: go.t().matmul(x))
        a = timed(lambda: main_grad.add_(go.t().matmul(x)))
        b = timed(lambda: add_compiled(main_grad, go.t().matmul(x)))
        try:
            c = timed(lambda: torch.ops.aten.addmm.dtype_out(main_grad, go.t(), x, torch.float32, out=main_grad))
            ref = main_grad.clone().zero_()
            ref.add_((go.t().float() @ x.float()))
            m2 = torch.zeros_like(main_grad)
            torch.ops.aten.addmm.dtype_out(m2, go.t(), x, torch.float32, out=m2)
            torch.ops.aten.addmm.dtype_out(m2, go.t(), x, torch.float32, out=m2)
            err = float(((m2 - 2 * ref).abs().max() / ref.abs().max()).item())
        except Exception as e:  # noqa: BLE001 -- reported
            c, err = None, repr(e)[:200]
        print(json.dumps(dict(weight=name, shape=[out_f, in_f], gemm_bf16_ms=round(gemm_only, 4), gemm_then_add_ms=round(a, 4),
                              gemm_then_compiled_add_ms=round(b, 4), fused_addmm_dtype_out_ms=None if c is None else round(c, 4),
                              fused_rel_err_after_2=err)), flush=True)


if __name__ == "__main__":
    main()
