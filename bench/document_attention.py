"""Document-masked attention (`mptrain.layers.document_mask`) vs plain causal flash attention, one device.

    python bench/document_attention.py [--seq 8192,32768,65536] [--mean-document 2048] [--heads 32]
                                       [--head-dim 64] [--batch 1] [--dtype bf16] [--reps 10] [--out FILE]
    python bench/document_attention.py --smoke        # CPU, fp32, s = 256: the script runs end to end

For each sequence length s, on the same q, k, v ``[b, heads, s, hn]`` (gpt_1.3b's attention by default:
32 heads × 64) and the same documents (lengths drawn from an exponential distribution of mean
``--mean-document``, cut at s; every row of the batch alike), one JSON row per variant:
- ``causal``: ``scaled_dot_product_attention(is_causal=True)`` (flash attention on CUDA), no documents;
- ``documents``: `document_attention` with the micro-batch's `DocumentMask` (FlexAttention, compiled, on
  CUDA; per-document SDPA elsewhere), the block mask built beforehand as training builds it once for all
  layers (its build time is ``mask_build_ms``, once per micro-batch);
- ``dense``: SDPA with the ``[b, 1, s, s]`` mask the data path used to build (up to ``--dense-max-seq``).
Keys: bench, variant, backend, seq_length, batch, heads, head_dim, dtype, device, gpu_name, torch,
documents, mean_document, time_ms (median forward + backward), times_ms, peak_mem_gib (the step's peak
allocation above what was allocated before it, CUDA; null on CPU), mask_build_ms, tiles_computed (the
block mask's share of the 128 × 128 tiles of the full square that run), time_vs_causal,
max_abs_diff (``documents``: output vs the per-document SDPA reference at the smallest s), error
(a variant that failed, e.g. out of memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mptrain.layers.document_mask import DocumentMask, document_attention, document_backend  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def document_lengths(seq_length: int, mean: int, seed: int) -> list:
    """Lengths (>= 1) of exponential mean ``mean`` until they fill ``seq_length``; the last one cut."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq_length:
        n = max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=g).item()))
        n = min(n, seq_length - total)
        lengths.append(n)
        total += n
    return lengths


def cu_seqlens(lengths: list, batch: int, seq_length: int, device) -> torch.Tensor:
    """``[b, s + 1]`` int64: 0, the document starts, s repeated (every row the same documents)."""
    row = torch.full((seq_length + 1,), seq_length, dtype=torch.int64)
    row[0] = 0
    row[1:len(lengths)] = torch.tensor(lengths[:-1]).cumsum(0)
    return row.expand(batch, -1).contiguous().to(device)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(fn, inputs, *, reps: int, warmup: int, device) -> dict:
    """Median forward + backward time (ms) of ``fn(*inputs)``, and the peak allocation above the start (CUDA)."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn(*inputs).sum().backward()
    times, peak = [], None
    for _ in range(reps):
        for t in inputs:
            t.grad = None
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn(*inputs).backward(inputs[0].new_ones(inputs[0].shape))
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        if cuda:
            peak = max(peak or 0.0, (torch.cuda.max_memory_allocated() - before) / 2**30)
    return {"time_ms": statistics.median(times), "times_ms": [round(t, 4) for t in times], "peak_mem_gib": peak}


def _tiles_computed(mask: DocumentMask, backend: str) -> Optional[float]:
    """The block mask's share of the 128 × 128 tiles of the full s × s square that run (flex only)."""
    if backend != "flex":
        return None
    blocks = mask.block_mask()
    total = blocks.kv_num_blocks.numel() * blocks.kv_num_blocks.shape[-1]  # [b, 1, q_tiles] × kv tiles (= q tiles)
    run = blocks.kv_num_blocks.sum() + (blocks.full_kv_num_blocks.sum() if blocks.full_kv_num_blocks is not None else 0)
    return float(run) / total


def rows_for(s: int, args, env: dict, device, dtype, first: bool) -> list:
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (args.batch, args.heads, s, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype).requires_grad_(True) for _ in range(3))
    lengths = document_lengths(s, args.mean_document, args.seed)
    cu = cu_seqlens(lengths, args.batch, s, device)
    backend = args.backend or document_backend(device, head_dim=args.head_dim)
    base = {"bench": "document_attention", "seq_length": s, "batch": args.batch, "heads": args.heads,
            "head_dim": args.head_dim, "dtype": args.dtype, "device": str(device), **env,
            "documents": len(lengths), "mean_document": args.mean_document}
    rows = []

    def run(variant: str, fn, **extra) -> dict:
        row = {**base, "variant": variant, **extra}
        try:
            row.update(measure(fn, (q, k, v), reps=args.reps, warmup=args.warmup, device=device))
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        return row

    causal = run("causal", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), backend="sdpa")
    mask = DocumentMask(cu)
    _sync(device)
    start = time.perf_counter()
    mask.prepare(backend)
    _sync(device)
    build_ms = (time.perf_counter() - start) * 1e3
    documents = run("documents", lambda a, b, c: document_attention(a, b, c, mask, backend=backend), backend=backend,
                    mask_build_ms=build_ms, tiles_computed=_tiles_computed(mask, backend))
    if first and "error" not in documents:  # the kernel's values against each document alone
        with torch.no_grad():
            got = document_attention(q, k, v, mask, backend=backend)
            want = document_attention(q, k, v, mask, backend="per_document")
        documents["max_abs_diff"] = (got.float() - want.float()).abs().max().item()
    if "error" not in causal and "error" not in documents:
        documents["time_vs_causal"] = documents["time_ms"] / causal["time_ms"]
    if s <= args.dense_max_seq:
        dense = mask.dense()
        run("dense", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=~dense), backend="sdpa")
        del dense
    return rows


def environment(device) -> dict:
    cuda = torch.device(device).type == "cuda"
    return {"gpu_name": torch.cuda.get_device_name(device) if cuda else None, "torch": torch.__version__,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="8192,32768,65536", help="comma-separated sequence lengths")
    ap.add_argument("--mean-document", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=["flex", "per_document"], default=None, help="default: per device")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dense-max-seq", type=int, default=32768, help="the dense-mask rows up to this s")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="also append the rows to this JSONL file")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, s = 256, 2 heads × 16, 1 rep: runs end to end")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.seq, args.mean_document = "cpu", "fp32", "256", 64
        args.heads, args.head_dim, args.reps, args.warmup = 2, 16, 1, 0
    return args


def main(argv=None) -> list:
    args = parse(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    env = environment(device)
    rows = []
    for i, s in enumerate(int(x) for x in args.seq.split(",")):
        for row in rows_for(s, args, env, device, dtype, first=i == 0):
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
