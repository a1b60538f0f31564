"""Which arithmetic torch's CUDA fused AdamW kernel does: one step of ``torch._fused_adamw_`` on 1M random
elements against candidate formulas (float64 scalars as in fused_adam_utils.cuh, float32 throughout) and
`mptrain.precision.flat_adam.flat_adam_math` eager and compiled. Prints mismatch counts per output.

    python3 bench/flat_adam_diag.py        # GPU
"""

import json

import torch

from mptrain.precision.flat_adam import _kernel, flat_adam_math


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n, lr, b1, b2, wd, eps, scale = 1 << 20, 3e-4, 0.9, 0.999, 0.1, 1e-8, 36.0
    p0 = torch.randn(n, generator=gen, device=dev) * 0.02
    g0 = torch.randn(n, generator=gen, device=dev) * 1e-3
    m0 = torch.randn(n, generator=gen, device=dev) * 1e-5
    v0 = torch.rand(n, generator=gen, device=dev) * 1e-9
    out = {}
    p, g, m, v = p0.clone(), g0.clone(), m0.clone(), v0.clone()
    step = torch.tensor(3.0, device=dev)
    torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                        amsgrad=False, maximize=False, grad_scale=torch.tensor(scale, device=dev),
                        found_inf=torch.tensor(0.0, device=dev))
    torch_out = {"grad": g, "param": p, "exp_avg": m, "exp_avg_sq": v}
    gs64 = (g0.double() / scale).float()
    gs32 = g0 / torch.tensor(scale, device=dev)
    cands = {
        "grad:f64div": gs64, "grad:f32div": gs32,
        "exp_avg:f64": (b1 * m0.double() + (1 - b1) * gs64.double()).float(),
        "exp_avg:f32": torch.tensor(b1, device=dev) * m0 + torch.tensor(1 - b1, device=dev) * gs64,
        "exp_avg:lerp32": m0.lerp(gs64, 1 - b1),
        "exp_avg_sq:f64": (b2 * v0.double() + (1 - b2) * gs64.double() * gs64.double()).float(),
        "exp_avg_sq:f32": torch.tensor(b2, device=dev) * v0 + torch.tensor(1 - b2, device=dev) * gs64 * gs64,
        "exp_avg_sq:f32_b2f": v0 * b2 + gs64 * gs64 * (1 - b2),
    }
    for key, val in cands.items():
        name = key.split(":")[0]
        out[key] = int((val != torch_out[name]).sum())
    for label, (fn, f64) in {"eager": (flat_adam_math, False), "compiled": _kernel("cuda")}.items():
        t = dict(param=p0.clone(), grad=g0.clone(), exp_avg=m0.clone(), exp_avg_sq=v0.clone(),
                 model_param=torch.zeros(n, dtype=torch.bfloat16, device=dev), group=torch.zeros(n, dtype=torch.uint8, device=dev))
        fn(**t, hyper=torch.tensor([[lr, wd]], dtype=torch.float64, device=dev),
           consts=torch.tensor([b1, b2, 1 - b1, 1 - b2, eps], dtype=torch.float64, device=dev),
           step=torch.tensor(3.0, device=dev), divisor=torch.tensor(scale, device=dev),
           found_inf=torch.tensor(0.0, device=dev), decoupled=True, div_through_f64=f64)
        for name in ("param", "exp_avg", "exp_avg_sq"):
            out[f"{name}:{label}"] = int((t[name] != torch_out[name]).sum())
    print(json.dumps({"bench": "flat_adam_diag", "n": n, "torch": torch.__version__, "mismatches_vs_torch_fused": out}))


if __name__ == "__main__":
    main()
