"""Conjugate communication operators of tensor and sequence parallelism (autograd Functions).

Legend: activations are ``[s, b, h]``; "TP region" = the ranks of ``groups.tp_group``.
Megatron-LM paper (Shoeybi et al. 2019, §3, Fig. 3) names the pair f / g:

=================================  ===============================  ==============================
function                           forward                          backward
=================================  ===============================  ==============================
copy_to_tp_region        (f)       identity                         all-reduce
reduce_from_tp_region    (g)       all-reduce                       identity
scatter_to_tp_region               keep own slice of the last dim   all-gather on the last dim
gather_from_tp_region              all-gather on the last dim       keep own slice of the last dim
scatter_to_sequence_parallel       keep own slice of dim 0 (s)      all-gather on dim 0
gather_from_sequence_parallel      all-gather on dim 0              reduce-scatter on dim 0
reduce_scatter_to_sequence_par.    reduce-scatter on dim 0          all-gather on dim 0
=================================  ===============================  ==============================

(Sequence-parallel pair: Korthikanti et al. 2022, §4.2.2, operators g / ḡ.) Every function takes
the process group explicitly and returns its input unchanged when the group has one rank.
In eager mode NCCL uses the tensor collectives; on gloo (CPU tests) a reduce-scatter is an
all-reduce followed by keeping this rank's slice (same result, more traffic). Under torch.compile
every collective is the functional one (``torch.ops._c10d_functional``) on both backends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mptrain.errors import ConfigError


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


# --- raw collectives (no autograd) -------------------------------------------------------------
# Under torch.compile (model.compile_layers) every collective is the functional one + wait_tensor,
# never an in-place c10d op for Dynamo to rewrite: on NCCL the rewritten clone + in-place
# all-reduce / reduce-scatter of the row-parallel forward left every layer weight's grad wrong
# while gloo got it right (bench/reports/2026-11-30-compile-tp-correctness.md).
_fc = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """``op`` ("sum" | "max") over `group`; in eager mode in place on ``x.contiguous()`` (callers pass a
    fresh tensor)."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return _fc.wait_tensor(_fc.all_reduce(x, op, group.group_name))
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on each of p ranks -> [p*n, ...] (rank order)."""
    x = x.contiguous()
    p = _size(group)
    if torch.compiler.is_compiling():
        return _fc.wait_tensor(_fc.all_gather_into_tensor(x, p, group.group_name))
    if _is_nccl(group):
        out = torch.empty((p * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """[p*n, ...] on each of p ranks -> sum over ranks of this rank's [n, ...] slice."""
    p = _size(group)
    if x.shape[0] % p != 0:
        raise RuntimeError(f"reduce-scatter: dim 0 ({x.shape[0]}) is not divisible by the group size {p}")
    x = x.contiguous()
    n = x.shape[0] // p
    if torch.compiler.is_compiling():
        return _fc.wait_tensor(_fc.reduce_scatter_tensor(x, "sum", p, group.group_name))
    if _is_nccl(group):
        out = torch.empty((n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    x = x.clone()
    dist.all_reduce(x, group=group)
    r = _rank(group)
    return x[r * n:(r + 1) * n].contiguous()


def enable_tp_comm_overlap(group) -> None:
    """``parallel.tp_comm_overlap``: let Inductor split SP collectives and their GEMMs into per-rank steps.

    Turns on Inductor's micro-pipeline TP pass (torch's async TP, as torchtitan's
    ``enable_async_tp``): in compiled layers, ``all_gather_into_tensor`` → matmul becomes
    ``symm_mem.fused_all_gather_matmul`` and matmul → ``reduce_scatter_tensor`` becomes
    ``fused_matmul_reduce_scatter``, each computing on one rank's chunk while the next chunk moves
    over NVLink. The TP group gets symmetric memory (peer-to-peer buffers; no NVLink multicast).
    Process-wide: the Inductor flag applies to every later compile in this process.

    Raises:
        ConfigError: the group is not NCCL (symmetric memory is CUDA-only).
    """
    if group is None or not _is_nccl(group):
        raise ConfigError("parallel.tp_comm_overlap=true needs CUDA GPUs and NCCL (symmetric memory); set it false on CPU")
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group.group_name)


def _split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal slice of ``dim``."""
    p = _size(group)
    if x.shape[dim] % p != 0:
        raise RuntimeError(f"split: dim {dim} of size {x.shape[dim]} is not divisible by the group size {p}")
    return x.chunk(p, dim=dim)[_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    p = _size(group)
    stacked = _all_gather_dim0(x.unsqueeze(0), group)  # [p, ...]
    return torch.cat(stacked.unbind(0), dim=-1) if p > 1 else x


class PendingCollective:
    """An input-grad collective in flight; `wait` returns its result (see `start_grad_collective`)."""

    def __init__(self, tensor: torch.Tensor, work=None, keep_slice=None, functional: bool = False) -> None:
        self._tensor, self._work, self._slice, self._functional = tensor, work, keep_slice, functional

    def wait(self) -> torch.Tensor:
        t = self._tensor
        if self._functional:
            t = _fc.wait_tensor(t)
        elif self._work is not None:
            self._work.wait()
        if self._slice is not None:
            r, n = self._slice
            t = t[r * n:(r + 1) * n].contiguous()
        return t


def start_grad_collective(grad: torch.Tensor, group, sequence_parallel: bool) -> PendingCollective:
    """Launch the SUM of a partial input grad ``[s, b, h]`` over `group` without waiting.

    Without SP: all-reduce (result ``[s, b, h]``). With SP: reduce-scatter on dim 0 (result
    ``[s/tp, b, h]``; eager gloo: an all-reduce + own slice, as `_reduce_scatter_dim0`). Eager mode
    uses ``async_op=True``; under torch.compile the functional collectives (Dynamo cannot trace
    ``async_op=True``; Inductor places the ``wait_tensor``).

    Raises:
        RuntimeError: under SP, dim 0 not divisible by the group size.
    """
    p = _size(group)
    grad = grad.contiguous()
    if sequence_parallel and grad.shape[0] % p != 0:
        raise RuntimeError(f"reduce-scatter: dim 0 ({grad.shape[0]}) is not divisible by the group size {p}")
    if torch.compiler.is_compiling():
        if sequence_parallel:
            return PendingCollective(_fc.reduce_scatter_tensor(grad, "sum", p, group.group_name), functional=True)
        return PendingCollective(_fc.all_reduce(grad, "sum", group.group_name), functional=True)
    n = grad.shape[0] // p
    scatter = sequence_parallel and _is_nccl(group)
    keep = (_rank(group), n) if sequence_parallel and not scatter else None
    if scatter:
        out = torch.empty((n,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        return PendingCollective(out, dist.reduce_scatter_tensor(out, grad, group=group, async_op=True))
    return PendingCollective(grad, dist.all_reduce(grad, group=group, async_op=True), keep_slice=keep)


def gather_from_sequence_parallel_region_raw(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``[s/tp, b, h] -> [s, b, h]`` on dim 0 without autograd (rank order)."""
    return _all_gather_dim0(x, group)


# --- autograd Functions ----------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, inplace):
        if torch.compiler.is_compiling():
            # functional, out of place, whatever `inplace` says: mutating a graph intermediate cost a
            # copy and kept activations alive (slower and more memory:
            # bench/reports/2026-11-30-megatron-core.md)
            return _all_reduce(x, group)
        if not inplace or not x.is_contiguous():
            return _all_reduce(x.clone() if x.is_contiguous() else x, group)  # contiguous() copies
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_grad_is_partial):
        ctx.group, ctx.partial = group, output_grad_is_partial
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return _reduce_scatter_dim0(grad, ctx.group), None, None
        return _split_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


# --- public API --------------------------------------------------------------------------------
def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """f (Megatron ``copy_to_tensor_model_parallel_region``): identity fwd, all-reduce of the grad bwd."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group, *, inplace: bool = False) -> torch.Tensor:
    """g (``reduce_from_tensor_model_parallel_region``): all-reduce SUM fwd, identity bwd.

    ``inplace``: reduce into `x` itself (Megatron's ``_reduce`` does); only for a fresh tensor no
    one else reads, e.g. a row-parallel matmul's partial output. Saves one ``[s, b, h]`` copy in
    eager mode; under torch.compile the reduce is always the out-of-place functional one.
    """
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group, inplace)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """[..., n] -> [..., n/tp] (own slice) fwd; all-gather on the last dim bwd."""
    return x if _size(group) == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """[..., n/tp] -> [..., n] (all-gather, rank order) fwd; own slice of the grad bwd."""
    return x if _size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """[s, b, h] -> [s/tp, b, h] (own slice) fwd; all-gather on dim 0 bwd."""
    return x if _size(group) == 1 else _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, *, output_grad_is_partial: bool = True) -> torch.Tensor:
    """[s/tp, b, h] -> [s, b, h] (all-gather) fwd.

    Backward: reduce-scatter on dim 0 when each rank's grad is a partial sum (the output feeds a
    column-parallel matmul, the usual case), or just the own slice when the grad is replicated.
    """
    return x if _size(group) == 1 else _GatherFromSP.apply(x, group, output_grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """[s, b, h] partial sums -> [s/tp, b, h] summed (reduce-scatter) fwd; all-gather on dim 0 bwd."""
    return x if _size(group) == 1 else _ReduceScatterToSP.apply(x, group)
