"""Causal attention over a sequence split across the context-parallel ranks (``parallel.cp_comm_type``).

Legend: ``b`` micro-batch, ``np`` query heads and ``ng`` K/V heads of this TP rank, ``d`` head dim, ``s`` the
full sequence, ``sl = s/cp`` this rank's tokens: chunks r and 2·cp − 1 − r of 2·cp (`context_parallel`), each of
``c = sl/2`` tokens. Query head i uses K/V head ``i // (np/ng)``.

``p2p`` (ring attention; Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the causal load
balance of Megatron / TransformerEngine ``context_parallel.cu`` and PyTorch's ``_templated_ring_attention``):
cp steps; at step i rank r holds the K/V of rank j = (r − i) mod cp, and the exchange of that block with the
ring neighbours (send to r + 1, receive from r − 1) runs while this step's block is computed. With the
chunks r < 2·cp − 1 − r and j < 2·cp − 1 − j:
  * i = 0 (j = r): the local [q_r, q_2cp-1-r] against the local K/V is plain causal attention on 2c tokens;
  * j < r: both query chunks see all of K/V chunk j and none of chunk 2·cp − 1 − j (no mask);
  * j > r: only the second query chunk sees anything, and it sees both K/V chunks (no mask).
Every step after the first costs half a block, so the ranks stay balanced. Block results (out_b, lse_b)
merge by their log-sum-exp in fp32 (online softmax, Milakov & Gimelshein 2018):
``lse' = log(e^lse + e^lse_b)``, ``out' = out·e^(lse − lse') + out_b·e^(lse_b − lse')``.
The backward pass (FlashAttention-2's block backward with the final out and lse) rotates K/V again and
sends each block's dK/dV accumulator along with it; after cp hops it is back on its owner, whole.
The exchange of K/V never waits for the block it overlaps; the accumulator's send overlaps the next block.
With document masking (``data.reset_attention_mask``) every rank knows the whole sequence's documents, and each
step computes only the (query chunk, key chunk) blocks in which some query sees some key (`cp_blocks`): fully
visible blocks through the flash kernel, blocks cut by a document boundary through the fp32 matmuls with a
``[b, 1, c, c]`` mask; a skipped block adds nothing to the merge or to the backward's accumulators.

``a2a`` (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns each of q, k, v from ``[sl, b, heads, d]``
into ``[s, b, heads/cp, d]`` (this rank's share of the heads, the whole sequence), plain causal attention runs on
it, and the inverse all-to-all brings the context back to ``[sl, b, heads, d]``; the heads of a TP rank (query and
K/V) must split over cp. The backward of each all-to-all is the reverse exchange.

``all_gather``: K/V of every CP rank gathered (backward: their grads reduce-scattered), put in global order,
and this rank's queries attend with a mask built from the global positions (or the rows of a dense
document mask, or per chunk `document_attention` from the document offsets: `data.reset_attention_mask`).
Exact and simple; the gathered K/V cost s/sl times the memory. ``a2a`` with documents runs `document_attention`
on its heads' whole sequence, as at cp = 1.

Block kernels (`block_kernel`): ATen's flash-attention ops, which return the log-sum-exp and take the final
(out, lse) in their backward (on CPU any float dtype; on CUDA fp16 / bf16 with head dims up to 256); elsewhere
(fp32 or wide heads on CUDA) the block is two fp32 matmuls around an explicit softmax (`block_forward`,
`block_backward`: scores ``[b, np, rows, cols]`` of one block at a time). Merging and accumulation are fp32.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mptrain.layers.context_parallel import chunk_bounds, local_positions
from mptrain.layers.cp_blocks import causal_plan, document_plan
from mptrain.layers.document_mask import DocumentMask, document_attention
from mptrain.layers.dtypes import HALF_DTYPES
from mptrain.layers.mappings import all_to_all, gather_from_sequence_parallel_region

_KV_TAG, _DKV_TAG = 61, 62  # distinct tags: the K/V and the dK/dV hops between one pair of ranks never mix
_FLASH_MAX_HEAD_DIM = 256  # flash-attention 2 (CUDA): head dims up to 256, multiples of 8


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[b, ng, n, d]`` -> ``[b, ng·rep, n, d]`` (head i uses K/V head i // rep)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(x: torch.Tensor, rep: int) -> torch.Tensor:
    """The grad of `_expand`: ``[b, ng·rep, n, d]`` -> ``[b, ng, n, d]`` (sum over each group's query heads)."""
    if rep == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // rep, rep, n, d).sum(dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``q kᵀ / sqrt(d)`` ``[b, h, rows, cols]``; causal (rows = cols): −inf above the diagonal; ``visible``
    (``[b, 1, rows, cols]`` bool, a document-masked block): −inf where False."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n = scores.shape[-1]
        scores.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    return scores


def block_forward(q, k, v, causal: bool, visible: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q ``[b, h, rows, d]``, k, v ``[b, h, cols, d]`` -> (out ``[b, h, rows, d]``, lse ``[b, h, rows]``), fp32.
    A query that sees no key of the block (``visible``) gets out 0 and lse −inf: it adds nothing to the merge."""
    scores = _scores(q, k, causal, visible)
    lse = torch.logsumexp(scores, dim=-1)
    # exp(−inf − 0) = 0 for a query without keys, where exp(−inf − lse) would be nan
    out = torch.matmul(torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1)), v.float())
    return out, lse


def block_backward(q, k, v, dout, lse, delta, causal: bool, visible: Optional[torch.Tensor] = None):
    """The block's (dq, dk, dv) in fp32 given the final ``lse`` and ``delta = rowsum(dout · out)`` ``[b, h, rows]``
    (FlashAttention-2, Dao 2023, Algorithm 2): P = exp(S − lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − delta).
    The final lse is finite (every query sees itself), so masked scores give P = 0."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(_scores(q, k, causal, visible) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.float().transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, dk, dv


def block_kernel(q: torch.Tensor) -> str:
    """The block kernel for q's device, dtype and head dim: "cpu_flash", "cuda_flash" or "matmul" (module docstring)."""
    if q.device.type == "cpu":
        return "cpu_flash"
    d = q.shape[-1]
    if q.device.type == "cuda" and q.dtype in HALF_DTYPES and d <= _FLASH_MAX_HEAD_DIM and d % 8 == 0:
        return "cuda_flash"
    return "matmul"


def _fwd(kernel: str, q, k, v, causal: bool,
         visible: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[tuple]]:
    """One block's (out, lse) in fp32 and, for the CUDA kernel, the forward's (cum_seq_q, cum_seq_k, rng_state,
    unused) that its backward takes back; q ``[b, h, rows, d]``, k, v ``[b, h, cols, d]`` (equal head counts).
    A masked block (``visible``, `cp_blocks.Block`) always runs the fp32 matmuls: the flash kernels take no mask."""
    if kernel == "matmul" or visible is not None:
        return (*block_forward(q, k, v, causal, visible), None)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out.float(), lse.float(), None
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    return res[0].float(), res[1].float(), (res[2], res[3], res[6], res[7])


def _bwd(kernel: str, q, k, v, dout, out, lse, delta, causal: bool, meta: Optional[tuple] = None,
         visible: Optional[torch.Tensor] = None):
    """One block's (dq, dk, dv) in fp32 from the final ``out`` (q's dtype), ``lse`` and ``delta`` (fp32; the flash
    kernels compute delta themselves from ``out``). ``meta``: a CUDA forward's metadata (`_fwd`; without dropout
    or variable lengths every block's is alike: PyTorch's own ring passes one forward's to every block).
    ``visible``: a masked block's mask (the fp32 matmuls, as in `_fwd`)."""
    if kernel == "matmul" or visible is not None:
        return block_backward(q, k, v, dout.float(), lse, delta, causal, visible)
    q, k, v, dout, out, lse = (t.contiguous() for t in (q, k, v, dout, out, lse))
    if kernel == "cpu_flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    else:
        cum_q, cum_k, seed, offset = meta
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset)
    return tuple(g.float() for g in grads)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running ones, in place (fp32; module docstring)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


class _Ring:
    """This rank's place in the CP ring: its index, size, the global ranks of its neighbours and the group."""

    def __init__(self, groups) -> None:
        ranks = groups.ranks["cp"]
        self.rank, self.size, self.group = groups.cp_rank, groups.cp_size, groups.cp_group
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[list, torch.Tensor]:
        """Start sending ``send`` to the next rank and receiving its like from the previous one; (works, recv)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), recv


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def forward_blocks(kernel: str, q, kv, blocks: list, out, lse, rep: int) -> Optional[tuple]:
    """Fold one ring step's blocks (`cp_blocks.Block`) into the running ``out`` ``[b, np, sl, d]`` and ``lse``
    ``[b, np, sl]`` (fp32, in place); q ``[b, np, sl, d]``, kv ``[2, b, ng, sl, d]`` the held K/V. Returns a CUDA
    flash forward's metadata (`_fwd`) or None. No process group: the ring's forward, step by step."""
    meta = None
    for blk in blocks:
        o, l, block_meta = _fwd(kernel, q[:, :, blk.rows], _expand(kv[0][:, :, blk.cols], rep),
                                _expand(kv[1][:, :, blk.cols], rep), blk.causal, blk.visible)
        meta = meta or block_meta
        merge(out[:, :, blk.rows], lse[:, :, blk.rows], o, l)
    return meta


def backward_blocks(kernel: str, q, kv, blocks: list, dout, out, lse, delta, dq, rep: int,
                    meta: Optional[tuple]) -> torch.Tensor:
    """One ring step's backward: adds the blocks' dQ into ``dq`` ``[b, np, sl, d]`` (fp32, in place) and returns
    their dK/dV ``[2, b, ng, sl, d]`` fp32 for the held K/V (zeros where no block looked: a skipped step).
    ``out``, ``lse``, ``delta``: the final ones (`_bwd`)."""
    acc = torch.zeros((2, *kv.shape[1:]), dtype=torch.float32, device=q.device)
    for blk in blocks:
        rows, cols = blk.rows, blk.cols
        bq, bk, bv = _bwd(kernel, q[:, :, rows], _expand(kv[0][:, :, cols], rep), _expand(kv[1][:, :, cols], rep),
                          dout[:, :, rows], out[:, :, rows], lse[:, :, rows], delta[:, :, rows], blk.causal, meta,
                          blk.visible)
        dq[:, :, rows] += bq
        acc[0][:, :, cols] += _fold(bk, rep)
        acc[1][:, :, cols] += _fold(bv, rep)
    return acc


class _RingAttention(torch.autograd.Function):
    """q ``[b, np, sl, d]``, k, v ``[b, ng, sl, d]`` -> out ``[b, np, sl, d]`` in q's dtype (module docstring);
    ``plan[step]``: the blocks of each step (`cp_blocks`)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, kernel: str, plan: list):
        rep = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # [2, b, ng, sl, d]: one message per hop
        meta = None
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            meta = forward_blocks(kernel, q, kv, plan[step], out, lse, rep) or meta
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        ctx.ring, ctx.kernel, ctx.meta, ctx.plan = ring, kernel, meta, plan
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, kernel = ctx.ring, ctx.kernel
        rep = q.shape[1] // k.shape[1]
        dout = dout.to(q.dtype)
        delta = (dout.float() * out.float()).sum(dim=-1)  # [b, np, sl]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        incoming = None  # the dK/dV accumulator of the block this rank holds, on its way from the previous rank
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            acc = backward_blocks(kernel, q, kv, ctx.plan[step], dout, out, lse, delta, dq, rep, ctx.meta)
            if incoming is not None:
                _wait(incoming[0])
                acc += incoming[1]
            # the accumulator travels with its block: to the next rank, which holds this block at the next step
            # (acc stays referenced beside its exchange until that is waited for)
            incoming = (*ring.exchange(acc, _DKV_TAG), acc)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        _wait(incoming[0])  # after cp hops the accumulator of this rank's own block is back, whole
        dkv = incoming[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


@torch.compiler.disable  # point-to-point exchanges inside an autograd Function: eager only
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups, kernel: Optional[str] = None,
                   documents: Optional[DocumentMask] = None) -> torch.Tensor:
    """``cp_comm_type=p2p``: q ``[b, np, sl, d]``, k, v ``[b, ng, sl, d]`` (RoPE applied) -> ``[b, np, sl, d]``.

    ``kernel``: the block kernel ("cpu_flash", "cuda_flash", "matmul"); None = `block_kernel` (q's device and dtype).
    ``documents``: the micro-batch's `DocumentMask` over the whole sequence (``data.reset_attention_mask``):
    causal within documents, blocks no query may see skipped (`cp_blocks.document_plan`); None = causal.
    Collective over ``groups.cp_group`` (every CP rank calls it for the same layer, forward and backward).
    """
    ring = _Ring(groups)
    if documents is None:
        plan = causal_plan(ring.size, ring.rank, q.shape[2])
    else:
        plan = document_plan(documents, ring.size, ring.rank)
    return _RingAttention.apply(q, k, v, ring, kernel or block_kernel(q), plan)


def _rank_order(cp: int) -> list:
    """``order[j]`` = the chunk of the rank-by-rank concatenation ``[cp·sl, ...]`` (rank r: chunks r, 2cp−1−r)
    that is chunk j of the sequence."""
    order = [0] * (2 * cp)
    for r in range(cp):
        order[r], order[2 * cp - 1 - r] = 2 * r, 2 * r + 1
    return order


def _global_order(x: torch.Tensor, cp: int) -> torch.Tensor:
    """The ranks' slices concatenated ``[cp·sl, ...]`` -> the sequence in order ``[s, ...]``."""
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[i] for i in _rank_order(cp)], dim=0)


def _rank_major(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Inverse of `_global_order`: the sequence ``[s, ...]`` -> the ranks' slices concatenated ``[cp·sl, ...]``."""
    chunks = x.chunk(2 * cp, dim=0)
    where = {c: j for j, c in enumerate(_rank_order(cp))}  # concatenation chunk c is sequence chunk where[c]
    return torch.cat([chunks[where[c]] for c in range(2 * cp)], dim=0)


def _heads_to_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``[sl, b, heads, d]`` -> ``[s, b, heads/cp, d]``: head group j goes to CP rank j, tokens come back in order."""
    sl, b, heads, d = x.shape
    parts = x.reshape(sl, b, cp, heads // cp, d).permute(2, 0, 1, 3, 4).reshape(cp * sl, b, heads // cp, d)
    return _global_order(all_to_all(parts.contiguous(), group), cp)


def _sequence_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of `_heads_to_sequence`: ``[s, b, heads/cp, d]`` -> ``[sl, b, heads, d]``."""
    s, b, h_local, d = x.shape
    back = all_to_all(_rank_major(x, cp).contiguous(), group)  # [cp·sl, ...]: chunk j = head group j, my tokens
    return back.reshape(cp, s // cp, b, h_local, d).permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * h_local, d)


@torch.compiler.disable  # collectives with uneven autograd: eager only
def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups,
                  documents: Optional[DocumentMask] = None) -> torch.Tensor:
    """``cp_comm_type=a2a``: q ``[sl, b, np, d]``, k, v ``[sl, b, ng, d]`` -> ``[b, np, sl, d]`` (causal SDPA on
    np/cp heads of the whole sequence; with ``documents``, the micro-batch's `DocumentMask`, causal within
    documents as at cp = 1: `document_attention`). np and ng (this TP rank's) divide by cp
    (`check_context_parallel`). Collective over ``groups.cp_group``."""
    cp, group = groups.cp_size, groups.cp_group
    qs, ks, vs = (_heads_to_sequence(t, group, cp) for t in (q, k, v))  # [s, b, heads/cp, d]
    rep = qs.shape[2] // ks.shape[2]
    qh = qs.permute(1, 2, 0, 3)
    kh, vh = _expand(ks.permute(1, 2, 0, 3), rep), _expand(vs.permute(1, 2, 0, 3), rep)
    if documents is not None:
        out = document_attention(qh, kh, vh, documents)  # [b, np/cp, s, d]
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)  # [b, np/cp, s, d]
    return _sequence_to_heads(out.permute(2, 0, 1, 3), group, cp).permute(1, 2, 0, 3)


@torch.compiler.disable  # collectives with uneven autograd: eager only
def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups,
                         attention_mask=None) -> torch.Tensor:
    """``cp_comm_type=all_gather``: q ``[sl, b, np, d]``, k, v ``[sl, b, ng, d]`` -> ``[b, np, sl, d]`` (SDPA).

    attention_mask: None (causal over global positions), this rank's rows of a dense mask ``[b, 1, sl, s]``
    bool, True = masked (`context_parallel.slice_batch`), columns in global order, or the micro-batch's
    `DocumentMask` over the whole sequence (each of this rank's two chunks against the keys up to its end:
    `document_attention` with the chunk's offset, no ``s × s`` mask).
    Collective over ``groups.cp_group``.
    """
    cp, sl = groups.cp_size, q.shape[0]
    k_all = _global_order(gather_from_sequence_parallel_region(k.contiguous(), groups.cp_group), cp)  # [s, b, ng, d]
    v_all = _global_order(gather_from_sequence_parallel_region(v.contiguous(), groups.cp_group), cp)
    rep = q.shape[2] // k.shape[2]
    qh = q.permute(1, 2, 0, 3)  # [b, np, sl, d]
    kh, vh = _expand(k_all.permute(1, 2, 0, 3), rep), _expand(v_all.permute(1, 2, 0, 3), rep)  # [b, np, s, d]
    if isinstance(attention_mask, DocumentMask):
        parts = []
        for i, (start, end) in enumerate(chunk_bounds(sl * cp, cp, groups.cp_rank)):
            rows = qh[:, :, i * (sl // 2):(i + 1) * (sl // 2)]  # the chunk's queries see keys before its end only
            parts.append(document_attention(rows, kh[:, :, :end], vh[:, :, :end], attention_mask, q_offset=start))
        return torch.cat(parts, dim=2)
    if attention_mask is None:
        pos = local_positions(sl * cp, cp, groups.cp_rank, device=q.device)
        attention_mask = torch.arange(sl * cp, device=q.device).unsqueeze(0) > pos.unsqueeze(1)  # [sl, s]
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=~attention_mask)
