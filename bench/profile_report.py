"""Kernel time split of a `torch.profiler` run, shared by `mptrain_entry.py --bench-profile` and
`profile_wrap.py` (the peer), so that both sides are categorised alike.

`write_profile` writes rank 0's file: a header line, the time per kernel category (ms per
iteration and %), with ``events`` the CPU ops that launched the eager kernels (`kernel_origins`), and
the top-40 table of `key_averages()` by device time.
"""

from __future__ import annotations

from pathlib import Path

# Kernel-name patterns -> a time-split category (first match wins; attention before GEMM because
# the memory-efficient attention kernels are CUTLASS kernels too).
KERNEL_CATEGORIES = (
    # NCCL's all-to-all (MoE token dispatch) and pipeline p2p are grouped send/recv kernels
    ("nccl send/recv (all-to-all, p2p)", ("nccldevkernel_sendrecv", "ncclkernel_sendrecv")),
    ("nccl", ("nccl",)),
    ("attention (flash/mem-efficient)", ("fmha", "flash", "attention", "efficient")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "nvjet", "gemv", "matmul")),
    # before multi-tensor: Inductor names kernels after the ops they fuse ("..._clamp_..." holds "amp_")
    ("triton (compiled)", ("triton",)),
    ("multi-tensor (optimizer/unscale/norm)", ("multi_tensor", "adam", "foreach", "unscale", "amp_")),
    ("softmax", ("softmax",)),
    ("layer_norm", ("layer_norm", "layernorm")),
    ("copy/cast/fill", ("copy", "memcpy", "memset", "cast", "fill")),
    ("elementwise/reduce", ("elementwise", "vectorized", "reduce", "unrolled")),
)


def kernel_category(name: str) -> str:
    """The time-split category of a CUDA kernel `name` (``KERNEL_CATEGORIES``; else "other")."""
    low = name.lower()
    for category, patterns in KERNEL_CATEGORIES:
        if any(p in low for p in patterns):
            return category
    return "other"


def is_kernel(e) -> bool:
    """A CUDA kernel / memcpy row of `key_averages()`, not a user annotation spanning kernels
    (``nccl:all_reduce``, ``record_param_comms``, ``Optimizer.step#...``), which would double count."""
    from torch.autograd import DeviceType

    if getattr(e, "device_type", None) != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
        return False
    return not (e.key.startswith(("nccl:", "Optimizer.")) or e.key == "record_param_comms")


def time_split(averages, iterations: int = 1) -> str:
    """Device time per kernel category (ms per iteration and %), from `key_averages()` over `iterations`."""
    totals: dict = {}
    for e in averages:
        if not is_kernel(e):
            continue
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        totals[kernel_category(e.key)] = totals.get(kernel_category(e.key), 0.0) + us
    whole = sum(totals.values()) or 1.0
    lines = [f"{'category':40s} {'ms/iter':>10s} {'%':>6s}"]
    for category, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"{category:40s} {us / 1e3 / iterations:10.2f} {100 * us / whole:6.1f}")
    lines.append(f"{'total kernel time':40s} {whole / 1e3 / iterations:10.2f}")
    return "\n".join(lines)


def kernel_origins(events, iterations: int = 1, top: int = 16) -> str:
    """Which CPU op chains launched the most device time outside CUDA graphs and compiled code.

    ``events``: ``prof.events()`` (`FunctionEvent`s; a CPU op lists its kernels through the launch
    correlation). Rows: ms per iteration, the kernel (60 chars), the launching op with its input
    shapes (when recorded) and up to 3 enclosing ops. Kernels launched by a graph replay or by
    Triton (no aten op) are left out: the split above already names them.
    """
    totals: dict = {}
    for e in events:
        kernels = getattr(e, "kernels", None)
        if not kernels or not e.name.startswith("aten::"):
            continue
        chain, parent = [], e.cpu_parent
        while parent is not None and len(chain) < 3:
            chain.append(parent.name[:40])
            parent = parent.cpu_parent
        shapes = str(getattr(e, "input_shapes", "") or "")[:70]
        for k in kernels:
            key = (k.name[:60], f"{e.name}{shapes}", " < ".join(chain))
            totals[key] = totals.get(key, 0.0) + k.duration
    lines = [f"{'ms/iter':>8s}  kernel | launching op [input shapes] | enclosing ops"]
    for (kname, op, chain), us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{us / 1e3 / iterations:8.2f}  {kname} | {op} | {chain}")
    return "\n".join(lines)


def write_profile(path: str, averages, *, iterations: int, cuda: bool, what: str, events=None) -> None:
    """Write the split (CUDA only), the kernel origins (with ``events``, CUDA only) and the top-40
    table of `averages` to `path`; `what` names the profiled span in the header (e.g. "5
    steady-state iterations after 3")."""
    key = "self_cpu_time_total"
    if cuda:
        key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    table = averages.table(sort_by=key, row_limit=40, max_name_column_width=90)
    split = time_split(averages, iterations) if cuda else ""
    origins = f"# eager kernels by launching op\n{kernel_origins(events, iterations)}\n\n" if cuda and events else ""
    Path(path).write_text(f"# time split by kernel category (rank 0, {what})\n{split}\n\n{origins}{table}")
