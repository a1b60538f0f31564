"""Device time of the eager grad-side passes of a gpt_1.3b step outside the compiled chunk (one GPU).

    python3 bench/grad_accum_ops.py [--out FILE.jsonl]

Each row: one way to do one pass, its median device time (CUDA events, 20 repeats after 5 warm-ups) and the bytes it
moves per element, so the effective bandwidth reads off. The passes:

* ``embedding_add``: the word embedding's lookup grad ``[V_pad, h]`` bf16 into its fp32 ``main_grad``
  view, once per micro-batch (`DistributedDataParallel`'s hook; the tied output use already went
  into ``main_grad`` through the fused weight-grad GEMM): ``add_`` with the cast inside (what the
  hook does), the cast first then a same-dtype ``add_``, and a compiled add;
* ``small_adds``: the 194 bias / LayerNorm-weight grads (bf16, 2048-8192 elements) into their fp32
  views, once per micro-batch: one mixed-dtype ``_foreach_add_`` (torch's slow path: one kernel per
  tensor, the hook's flush before `StagedAdd`), the shipped `mptrain.distributed.accumulate.StagedAdd`
  (the grads cast into an fp32 staging buffer by ``_foreach_copy_``, then a same-dtype
  ``_foreach_add_``), or ``torch.cat`` into a flat fp32 staging buffer then the add;
* ``zero_buffer``: zeroing the whole fp32 grad buffer (1.3B elements), once per step;
* ``param_copy``: the fp32 main params into the bf16 model params (``_foreach_copy_``), once per step.

Timings are benchmark numbers of this script only (no test asserts them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "src")]  # bench/ is not a package
from gemm_layouts import time_ms as timed  # noqa: E402  (median of 20 CUDA-event-timed calls after 5 warm-ups)
from mptrain.distributed.accumulate import StagedAdd  # noqa: E402

V_PAD, H = 50304, 2048
PARAMS = 1_315_575_808  # gpt_1.3b with a padded vocabulary, tp1


def _exact(fn, flat, start, reference) -> bool:
    """Whether ``fn`` from ``start`` gives bitwise the mixed-dtype add's ``reference``."""
    flat.copy_(start)
    fn()
    return bool(torch.equal(flat, reference))


def rows() -> list:
    dev = "cuda"
    main = torch.zeros(V_PAD, H, dtype=torch.float32, device=dev)
    grad = torch.randn(V_PAD, H, dtype=torch.bfloat16, device=dev)
    compiled_add = torch.compile(lambda v, g: v.add_(g), dynamic=False, fullgraph=True)
    n = V_PAD * H
    out = [
        dict(pass_="embedding_add", way="add_ (cast inside; the hook today)", ms=timed(lambda: main.add_(grad)),
             bytes_per_elem=10, elems=n),
        dict(pass_="embedding_add", way="add_(grad.float())", ms=timed(lambda: main.add_(grad.float())),
             bytes_per_elem=18, elems=n),
        dict(pass_="embedding_add", way="torch.compile add", ms=timed(lambda: compiled_add(main, grad)),
             bytes_per_elem=10, elems=n),
        dict(pass_="embedding_add", way="_foreach_add_", ms=timed(lambda: torch._foreach_add_([main], [grad])),
             bytes_per_elem=10, elems=n),
    ]
    del main, grad
    sizes = [2048 * 3, 2048, 8192, 2048, 2048, 2048, 2048, 2048] * 24 + [2048, 2048]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=dev)
    views = list(flat.split(sizes))
    grads = [torch.randn(s, dtype=torch.bfloat16, device=dev) for s in sizes]
    staging = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
    staged = list(staging.split(sizes))

    shipped = StagedAdd(dict(enumerate(sizes)), dtype=torch.float32, device=torch.device(dev))

    def staged_add():  # what the DDP hooks and their flush do
        for i, (view, grad) in enumerate(zip(views, grads)):
            shipped.queue(i, view, grad)
        shipped.flush()

    def cat_then_add():
        torch.cat(grads, out=staging)
        torch._foreach_add_(views, staged)

    start = torch.randn(sum(sizes), dtype=torch.float32, device=dev)
    flat.copy_(start)
    torch._foreach_add_(views, grads)
    reference = flat.clone()
    m = sum(sizes)
    for way, fn, bpe in (("mixed _foreach_add_ (the flush before StagedAdd)", lambda: torch._foreach_add_(views, grads), 10),
                         ("StagedAdd: _foreach_copy_ to fp32 staging + _foreach_add_", staged_add, 18),
                         ("cat into fp32 staging + _foreach_add_", cat_then_add, 18)):
        ms = timed(fn)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        out.append(dict(pass_="small_adds", way=way, ms=ms, bytes_per_elem=bpe, elems=m, kernels=kernels,
                        exact=_exact(fn, flat, start, reference)))
    del flat, views, grads, staging, staged
    buf = torch.empty(PARAMS, dtype=torch.float32, device=dev)
    out.append(dict(pass_="zero_buffer", way="zero_", ms=timed(buf.zero_), bytes_per_elem=4, elems=PARAMS))
    chunks = list(buf.split(PARAMS // 194))  # ~ the 1.3b's param count
    model = [torch.empty_like(c, dtype=torch.bfloat16) for c in chunks]
    out.append(dict(pass_="param_copy", way="_foreach_copy_ fp32->bf16",
                    ms=timed(lambda: torch._foreach_copy_(model, chunks)), bytes_per_elem=6, elems=PARAMS))
    for r in out:
        r["ms"] = round(r["ms"], 3)
        r["tb_per_s"] = round(r["elems"] * r["bytes_per_elem"] / (r["ms"] * 1e-3) / 1e12, 2)
        r["pass"] = r.pop("pass_")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="append the rows here (JSONL)")
    args = p.parse_args()
    device = torch.cuda.get_device_name()
    for r in rows():
        r.update(device=device, torch=torch.__version__)
        print(json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
