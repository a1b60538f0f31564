"""Cross entropy over vocabulary-sharded logits (Megatron ``tensor_parallel/cross_entropy.py``).

Rank r holds logits for padded vocab ids ``[r V_pad/tp, (r+1) V_pad/tp)``. Per token, with x the
full logit row over the V real entries and t the target:

    loss = log Σ_j exp(x_j) − x_t                                      (label_smoothing = 0)
    loss = log Σ_j exp(x_j) − (1−α) x_t − (α/V) Σ_j x_j,  α = ε V/(V−1)  (label smoothing ε, Megatron's α)

Computed with: the global max (all-reduce MAX) for stability; then ONE all-reduce SUM of the
stacked per-token triple (target logit, Σ exp, Σ logits) over TP. Padded vocab entries (ids ≥ V)
are set to −inf before the max, so they get probability 0 and no gradient (DESIGN.md §3).
Backward is local: ∂loss/∂x_j = softmax_j − (1−α)·1[j=t] − α/V·1[j<V].
The Σ logits term is a sum over the *global* vocabulary, so label smoothing is the same at any tp
(unlike NVIDIA/Megatron-LM#737, which used the local partition).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mptrain.layers.compile import compile_pass
from mptrain.layers.mappings import _all_reduce


_PROMOTED = (torch.float32, torch.float16, torch.bfloat16)  # dtypes that ``x - fp32 max`` computes in fp32


def _tp(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _loss_from_stats(stacked: torch.Tensor, vocab_size: int, label_smoothing: float) -> tuple:
    """Per-token loss from the TP-summed ``[..., (target logit, Σ exp, Σ logits)]`` (logits already
    shifted by the global max); returns (loss, Megatron's α = ε V/(V−1), 0 without smoothing)."""
    target_logit, log_z = stacked[..., 0], stacked[..., 1].log()
    if label_smoothing <= 0:
        return log_z - target_logit, 0.0
    alpha = label_smoothing * vocab_size / (vocab_size - 1)
    return log_z - (1.0 - alpha) * target_logit - alpha * (stacked[..., 2] / vocab_size), alpha


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        tp, rank = _tp(group)
        n_local = logits.shape[-1]
        start = rank * n_local
        col = torch.arange(start, start + n_local, device=logits.device)
        padded = col >= vocab_size  # [V_pad/tp]
        valid = min(max(vocab_size - start, 0), n_local)  # real vocab entries on this rank: [0, valid)
        # the max over the real entries only, read through a view: the same value as the max of the
        # logits with padded entries at −inf, without that masked fp32 copy
        if valid > 0:
            x_max = logits[..., :valid].amax(dim=-1).float()  # max is exact: same value as amax of logits.float()
        else:  # this rank holds padding only: −inf, the identity of the MAX all-reduce
            x_max = torch.full(logits.shape[:-1], float("-inf"), device=logits.device)
        if tp > 1:
            dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=group)
        # one pass makes the fp32 shifted logits (half inputs are promoted to fp32 exactly inside the
        # subtraction), then the padded columns are set to −inf: x ≤ 0, padded −inf
        x = (logits if logits.dtype in _PROMOTED else logits.float()) - x_max.unsqueeze(-1)
        if valid < n_local:
            x[..., valid:] = float("-inf")

        in_range = (target >= start) & (target < start + n_local)
        local_t = (target - start).masked_fill(~in_range, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        if label_smoothing > 0:
            exp_x = x.exp()  # padded -> 0
            stats = [target_logit, exp_x.sum(dim=-1), x.masked_fill(padded, 0.0).sum(dim=-1)]
        else:  # x is not read again: exponentiate it in place (no second [s, b, V/tp] fp32 tensor)
            exp_x = x.exp_()  # padded -> 0
            stats = [target_logit, exp_x.sum(dim=-1)]
        stacked = torch.stack(stats, dim=-1)
        if tp > 1:
            dist.all_reduce(stacked, group=group)  # the one SUM all-reduce
        loss, alpha = _loss_from_stats(stacked, vocab_size, label_smoothing)
        sum_exp = stacked[..., 1]
        softmax = exp_x.div_(sum_exp.unsqueeze(-1))
        ctx.alpha, ctx.vocab_size, ctx.in_dtype = alpha, vocab_size, logits.dtype
        ctx.save_for_backward(softmax, in_range, local_t, padded)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_range, local_t, padded = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - ctx.alpha) * in_range.to(grad.dtype).unsqueeze(-1))
        if ctx.alpha > 0:
            grad.sub_((ctx.alpha / ctx.vocab_size) * (~padded).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


# --- fused variant: three compiled passes over the logits, softmax recomputed in backward -------
def _masked_fp32(logits, start: int, vocab_size: int):
    """fp32 logits with padded vocab entries (ids ≥ V) at −inf, and the padded mask ``[n]``."""
    n = logits.shape[-1]
    col = torch.arange(start, start + n, device=logits.device)
    padded = col >= vocab_size
    return logits.float().masked_fill(padded, float("-inf")), padded


def _local_max(logits, start: int, vocab_size: int):
    x, _ = _masked_fp32(logits, start, vocab_size)
    return x.amax(dim=-1)  # [...] fp32


def _local_stats(logits, x_max, local_t, in_range, start: int, vocab_size: int, smoothing: bool):
    x, padded = _masked_fp32(logits, start, vocab_size)
    x = x - x_max.unsqueeze(-1)
    target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
    stats = [target_logit, x.exp().sum(dim=-1)]
    if smoothing:
        stats.append(x.masked_fill(padded, 0.0).sum(dim=-1))
    return torch.stack(stats, dim=-1)  # [..., 2 or 3]


def _local_grad_(logits, x_max, sum_exp, local_t, in_range, grad_loss, out, start: int, vocab_size: int, alpha: float):
    """Write the grad into ``out`` (may be ``logits`` itself: one pointwise pass, each element read before written)."""
    x, padded = _masked_fp32(logits, start, vocab_size)
    softmax = (x - x_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    col = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (col == local_t.unsqueeze(-1)) & in_range.unsqueeze(-1)
    grad = softmax - (1.0 - alpha) * onehot.to(softmax.dtype)
    if alpha > 0:
        grad = grad - (alpha / vocab_size) * (~padded).to(softmax.dtype)
    out.copy_(grad * grad_loss.unsqueeze(-1))


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """Same loss and grad as `_VocabParallelCrossEntropy` (module docstring), computed in three
    compiled passes over the logits (`mptrain.layers.compile.compile_pass`): local max; target
    logit + Σ exp (+ Σ logits); and, in backward, the grad with the softmax recomputed from the
    saved logits. No fp32 ``[s, b, V/tp]``
    softmax is kept between forward and backward (the logits, in the model dtype, are).

    ``inplace_backward``: write the grad over the saved logits instead of allocating it. Backward
    runs when nearly every activation is still alive, so a second ``[s, b, V/tp]`` tensor sets
    the step's peak memory (bench/reports/2026-11-30-megatron-core.md). Only for callers that own the logits
    (the GPT
    model: the output layer's backward needs its input and weight, not its output).
    Megatron's counterpart: ``cross_entropy_loss_fusion`` (whose unfused kernel also writes the
    grad over its saved softmax)."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing, inplace_backward=False):
        tp, rank = _tp(group)
        n_local = logits.shape[-1]
        start = rank * n_local
        x_max = compile_pass(_local_max)(logits, start, vocab_size)
        if tp > 1:  # functional under torch.compile (mappings' note on in-place c10d ops)
            x_max = _all_reduce(x_max, group, "max")
        in_range = (target >= start) & (target < start + n_local)
        local_t = (target - start).masked_fill(~in_range, 0)
        stacked = compile_pass(_local_stats)(logits, x_max, local_t, in_range, start, vocab_size, label_smoothing > 0)
        if tp > 1:
            stacked = _all_reduce(stacked, group)  # the one SUM all-reduce
        loss, alpha = _loss_from_stats(stacked, vocab_size, label_smoothing)
        ctx.alpha, ctx.vocab_size, ctx.start, ctx.inplace = alpha, vocab_size, start, inplace_backward
        ctx.save_for_backward(logits, x_max, stacked[..., 1].contiguous(), local_t, in_range)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, x_max, sum_exp, local_t, in_range = ctx.saved_tensors
        grad = logits if ctx.inplace else torch.empty_like(logits)
        compile_pass(_local_grad_)(logits, x_max, sum_exp, local_t, in_range, grad_loss.contiguous(), grad, ctx.start,
                                ctx.vocab_size, ctx.alpha)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, *, group=None,
                                 vocab_size: Optional[int] = None, label_smoothing: float = 0.0,
                                 fused: bool = False, inplace_backward: bool = False) -> torch.Tensor:
    """Per-token cross entropy of TP-sharded logits (fp32).

    Args:
        vocab_parallel_logits: ``[s, b, V_pad/tp]`` or ``[b, s, V_pad/tp]`` (any leading dims), any
            float dtype; this rank's contiguous slice of the padded vocabulary.
        target: int64 ids with the leading dims of the logits, each in [0, V).
        group: the TP process group (None: single rank).
        vocab_size: V, the real vocabulary; entries ≥ V are padding (default: no padding).
        label_smoothing: ε in [0, 1).
        fused: the compiled three-pass variant (`_FusedVocabParallelCrossEntropy`, used by the
            model with ``model.compile_layers``); same math as the plain one up to rounding
            (bench/reports/2026-11-30-compile-tp-correctness.md).
        inplace_backward: with ``fused``, backward writes the grad over the logits (they must not
            be read after backward, nor be a leaf); saves one ``[s, b, V/tp]`` tensor at peak.
    Returns:
        fp32 loss with the shape of ``target``.
    """
    tp, _ = _tp(group)
    if vocab_size is None:
        vocab_size = vocab_parallel_logits.shape[-1] * tp
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if fused:
        return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, vocab_size, label_smoothing,
                                                     inplace_backward)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, vocab_size, label_smoothing)
