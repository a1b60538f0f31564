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
all_to_all                         all-to-all on dim 0              all-to-all, splits swapped
=================================  ===============================  ==============================

(Sequence-parallel pair: Korthikanti et al. 2022, §4.2.2, operators g / ḡ.) Every function takes
the process group explicitly and returns its input unchanged when the group has one rank.
The dim-0 gather / reduce-scatter also take per-rank sizes (``output_split_sizes`` /
``input_split_sizes``, host ints in group-rank order) for uneven pieces, and `all_to_all` moves
rows of uneven counts: the expert-parallel token dispatch (Megatron ``tensor_parallel/mappings.py``
``all_to_all``, ``gather_from_sequence_parallel_region(output_split_sizes=)``,
``reduce_scatter_to_sequence_parallel_region(input_split_sizes=)``). gloo has no uneven
all-gather: there the uneven all-gather is an all-to-all that sends this rank's rows to every rank.
In eager mode NCCL uses the tensor collectives; on gloo (CPU tests) a reduce-scatter is an
all-reduce followed by keeping this rank's slice (same result, more traffic). Under torch.compile
every collective is the functional one (``torch.ops._c10d_functional``) on both backends.
"""

from __future__ import annotations

from typing import Optional

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


def _all_to_all(x: torch.Tensor, group, output_split_sizes: list, input_split_sizes: list) -> torch.Tensor:
    """Rows ``[sum(input_split_sizes), ...]`` -> ``[sum(output_split_sizes), ...]``: this rank's i-th chunk of
    ``input_split_sizes[i]`` rows goes to group rank i; chunk j of the result came from group rank j."""
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return _fc.wait_tensor(_fc.all_to_all_single(x, output_split_sizes, input_split_sizes, group.group_name))
    out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group)
    return out


def _all_gather_dim0_v(x: torch.Tensor, group, sizes: list) -> torch.Tensor:
    """Rank r's ``[sizes[r], ...]`` -> ``[sum(sizes), ...]`` (rank order)."""
    p, r = _size(group), _rank(group)
    if x.shape[0] != sizes[r]:
        raise RuntimeError(f"all-gather: this rank holds {x.shape[0]} rows, its split size says {sizes[r]}")
    x = x.contiguous()
    if not torch.compiler.is_compiling() and _is_nccl(group):
        out = x.new_empty((sum(sizes),) + tuple(x.shape[1:]))
        dist.all_gather(list(out.split(sizes)), x, group=group)
        return out
    # gloo's all-gather takes equal sizes only: send all of this rank's rows to every rank instead
    return _all_to_all(x.repeat(p, *([1] * (x.dim() - 1))), group, list(sizes), [x.shape[0]] * p)


def _reduce_scatter_dim0_v(x: torch.Tensor, group, sizes: list) -> torch.Tensor:
    """``[sum(sizes), ...]`` on each rank -> sum over ranks of rank r's ``[sizes[r], ...]`` slice."""
    r = _rank(group)
    if x.shape[0] != sum(sizes):
        raise RuntimeError(f"reduce-scatter: dim 0 ({x.shape[0]}) is not the sum of the split sizes {sizes}")
    x = x.contiguous()
    if not torch.compiler.is_compiling() and _is_nccl(group):
        out = x.new_empty((sizes[r],) + tuple(x.shape[1:]))
        dist.reduce_scatter(out, list(x.split(sizes)), group=group)
        return out
    start = sum(sizes[:r])
    summed = _all_reduce(x if torch.compiler.is_compiling() else x.clone(), group)  # eager: in place, on a copy
    return summed[start:start + sizes[r]].contiguous()


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
    def forward(ctx, x, group, output_grad_is_partial, sizes):
        ctx.group, ctx.partial, ctx.sizes = group, output_grad_is_partial, sizes
        return _all_gather_dim0(x, group) if sizes is None else _all_gather_dim0_v(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        sizes = ctx.sizes
        if sizes is None:
            out = _reduce_scatter_dim0(grad, ctx.group) if ctx.partial else _split_dim(grad, 0, ctx.group)
        elif ctx.partial:
            out = _reduce_scatter_dim0_v(grad, ctx.group, sizes)
        else:
            start = sum(sizes[:_rank(ctx.group)])
            out = grad[start:start + sizes[_rank(ctx.group)]].contiguous()
        return out, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_dim0(x, group) if sizes is None else _reduce_scatter_dim0_v(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        sizes = ctx.sizes
        out = _all_gather_dim0(grad, ctx.group) if sizes is None else _all_gather_dim0_v(grad, ctx.group, sizes)
        return out, None, None


class _AllToAll(torch.autograd.Function):
    """Rows to their group ranks; backward sends each row's grad back the way it came (splits swapped)."""

    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        return _all_to_all(x, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes), None, None, None


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


def gather_from_sequence_parallel_region(x: torch.Tensor, group, *, output_grad_is_partial: bool = True,
                                         output_split_sizes: Optional[list] = None) -> torch.Tensor:
    """[s/tp, b, h] -> [s, b, h] (all-gather) fwd.

    Backward: reduce-scatter on dim 0 when each rank's grad is a partial sum (the output feeds a
    column-parallel matmul, the usual case), or just the own slice when the grad is replicated.
    ``output_split_sizes``: rows held by each group rank (host ints, group-rank order) when they differ;
    the result has ``sum(output_split_sizes)`` rows (Megatron's keyword; the expert-tensor-parallel
    gather of the all-to-all token dispatcher).

    Raises:
        RuntimeError: this rank's rows differ from its split size.
    """
    if _size(group) == 1:
        return x
    sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
    return _GatherFromSP.apply(x, group, output_grad_is_partial, sizes)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, *,
                                               input_split_sizes: Optional[list] = None) -> torch.Tensor:
    """[s, b, h] partial sums -> [s/tp, b, h] summed (reduce-scatter) fwd; all-gather on dim 0 bwd.

    ``input_split_sizes``: rows that go to each group rank (host ints, group-rank order) when they differ
    (Megatron's keyword); this rank gets ``input_split_sizes[rank]`` rows.

    Raises:
        RuntimeError: dim 0 is not the sum of the split sizes (or, without them, not divisible by the group size).
    """
    if _size(group) == 1:
        return x
    sizes = None if input_split_sizes is None else [int(n) for n in input_split_sizes]
    return _ReduceScatterToSP.apply(x, group, sizes)


def all_to_all(x: torch.Tensor, group, *, output_split_sizes: Optional[list] = None,
               input_split_sizes: Optional[list] = None) -> torch.Tensor:
    """Variable all-to-all along dim 0 (Megatron ``tensor_parallel.mappings.all_to_all``).

    Forward: ``x [sum(input_split_sizes), ...]``; its i-th chunk of ``input_split_sizes[i]`` rows goes to
    group rank i, and the result ``[sum(output_split_sizes), ...]`` holds the chunks received, rank 0's
    first. Backward: the same exchange with the splits swapped, so each row's grad returns to the rank
    and the row it came from. Sizes are host ints in group-rank order; None = equal splits (dim 0 / p).
    One rank: the input itself.

    Raises:
        RuntimeError: (from torch.distributed) splits that do not add up to dim 0 or disagree between ranks.
    """
    p = _size(group)
    if p == 1:
        return x
    equal = [x.shape[0] // p] * p
    out_sizes = equal if output_split_sizes is None else [int(n) for n in output_split_sizes]
    in_sizes = equal if input_split_sizes is None else [int(n) for n in input_split_sizes]
    return _AllToAll.apply(x, group, out_sizes, in_sizes)
