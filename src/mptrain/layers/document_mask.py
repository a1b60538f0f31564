"""Document masking without an ``s × s`` mask (``data.reset_attention_mask=true``).

Legend: ``b`` micro-batch, ``s`` sequence, ``heads`` attention heads of this rank, ``hn`` head dim.

The rule is Megatron's (``megatron/core/datasets/gpt_dataset.py::_get_ltor_masks_and_position_ids``): a
document ends with its EOD token and the next one starts right after it; query position i sees key
position j iff j <= i and both lie in the same document. Instead of the ``[b, 1, s, s]`` mask the batch
carries the document boundaries as per-sequence cumulative offsets, ``cu_seqlens`` ``[b, s + 1]`` int64
(flash-attention's ``cu_seqlens``, one row per sequence): row r is 0, the start of each later document
of sequence r, then s, repeated up to the fixed width (trailing empty documents). Sequence r's documents
are ``[cu[r, j], cu[r, j + 1])``. The width s + 1 is the most a sequence of s tokens can need (s
one-token documents); being fixed, every rank knows the shape without exchanging it
(`mptrain.training.batch`), and it costs as much as one more ``[b, s]`` token tensor.

Two exact backends, chosen per device (`document_backend`):

* ``flex`` (CUDA): ``torch.nn.attention.flex_attention`` under ``torch.compile`` with a ``BlockMask``
  built from the document ids (``create_block_mask``, compiled). Tiles of 128 × 128 that no query may
  see (another document, or above the diagonal) are skipped, so time follows the documents, not s²
  (Dong et al. 2024, "Flex Attention"; torchtitan's document masking); the block mask holds tile indices,
  ``[b, 1, s/128, s/128]`` int32 (1 MiB per sequence at s = 64k, where the dense mask is 4 GiB). It is
  built once per micro-batch (`DocumentMask.prepare`, before the layers run) and shared by every layer.
* ``per_document`` (CPU; on CUDA with attention dropout, which FlexAttention lacks, or a head dim above
  256): one ``scaled_dot_product_attention(is_causal=True)`` per document slice, i.e. each document alone.
  A Python loop over the documents: inside a compiled region it runs eagerly (``torch.compiler.disable``).

Offsets: `document_attention` takes the positions of its query and key blocks within the sequence
(``q_offset``, ``kv_offset``), so a caller holding a slice of the sequence (a context-parallel ring step)
calls it per block; ``return_lse`` gives each query's log-sum-exp for merging partial results (a query
that sees no key of the block gets output 0 and log-sum-exp -inf).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from mptrain.layers.random import in_compiled_region

BACKENDS = ("flex", "per_document")
_FLEX_BLOCK = 128  # BlockMask's default tile: the unit of skipped work
_FLEX_MAX_HEAD_DIM = 256  # beyond it FlexAttention's Triton tiles do not fit in shared memory


class DocumentMask:
    """The document boundaries of one micro-batch and what the backends build from them, once per micro-batch.

    Args:
        cu_seqlens: ``[b, s + 1]`` int64 (module docstring): per sequence, 0, its document starts, then s
            repeated.
    Attributes:
        batch_size, seq_length: b and s.
    Everything built is cached on the object, so every layer (and every chunk) of the micro-batch reuses it;
    `prepare` builds it outside compiled regions.
    """

    def __init__(self, cu_seqlens: torch.Tensor) -> None:
        if cu_seqlens.dim() != 2:
            raise ValueError(f"DocumentMask: cu_seqlens must be [b, s + 1], got shape {list(cu_seqlens.shape)}")
        self.cu_seqlens = cu_seqlens
        self.batch_size, self.seq_length = cu_seqlens.shape[0], cu_seqlens.shape[1] - 1
        self._document_ids: Optional[torch.Tensor] = None
        self._segments: Optional[list] = None
        self._block_masks: dict = {}
        self._memo: dict = {}

    def document_ids(self) -> torch.Tensor:
        """``[b, s]`` int64: the index of each position's document in its sequence (no host read)."""
        if self._document_ids is None:
            positions = torch.arange(self.seq_length, device=self.cu_seqlens.device).expand(self.batch_size, -1)
            # the number of document ends at or before a position; the padding (= s) never counts
            self._document_ids = torch.searchsorted(self.cu_seqlens[:, 1:].contiguous(), positions.contiguous(),
                                                    right=True)
        return self._document_ids

    def segments(self) -> list:
        """Per sequence, its non-empty documents as ``(start, end)`` pairs (a host read of ``cu_seqlens``)."""
        if self._segments is None:
            self._segments = [[(a, z) for a, z in zip(row[:-1], row[1:]) if z > a] for row in self.cu_seqlens.tolist()]
        return self._segments

    def block_mask(self, q_offset: int = 0, q_len: Optional[int] = None, kv_offset: int = 0,
                   kv_len: Optional[int] = None):
        """The FlexAttention ``BlockMask`` of queries ``[q_offset, q_offset + q_len)`` against keys
        ``[kv_offset, kv_offset + kv_len)`` (default: the whole sequence), heads broadcast; compiled on CUDA
        (``_compile``: the mask is evaluated per tile, never as a ``q_len × kv_len`` tensor). Cached per block."""
        q_len = self.seq_length - q_offset if q_len is None else q_len
        kv_len = self.seq_length - kv_offset if kv_len is None else kv_len
        key = (q_offset, q_len, kv_offset, kv_len)
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            # padded past s (to whole tiles plus the offsets) with ids no query matches: a tile's tail reads them
            span = self.seq_length + _FLEX_BLOCK + max(q_offset, kv_offset)
            doc = F.pad(self.document_ids(), (0, span - self.seq_length), value=-1)

            def mask_mod(b, h, q_idx, kv_idx):
                q, k = q_idx + q_offset, kv_idx + kv_offset
                return (q >= k) & (doc[b, q] == doc[b, k])

            self._block_masks[key] = create_block_mask(mask_mod, self.batch_size, None, q_len, kv_len,
                                                       device=self.cu_seqlens.device,
                                                       _compile=self.cu_seqlens.is_cuda)
        return self._block_masks[key]

    def memo(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, called once per ``key`` for this micro-batch (a context-parallel ring's block plan,
        `mptrain.layers.cp_blocks`): every layer, recomputation and backward of the micro-batch reuses it."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def prepare(self, backend: str) -> None:
        """Build what ``backend`` reads (the whole-sequence block mask, or the host segments) now, outside any
        compiled region, so that the layers only look it up."""
        if backend == "flex":
            self.block_mask()
        else:
            self.segments()

    def dense(self) -> torch.Tensor:
        """The equivalent ``[b, 1, s, s]`` bool mask, True = masked (the dense path's; for references)."""
        doc = self.document_ids()
        pos = torch.arange(self.seq_length, device=doc.device)
        allowed = (pos[None, :, None] >= pos[None, None, :]) & (doc[:, :, None] == doc[:, None, :])
        return ~allowed[:, None]


def document_backend(device: torch.device, *, head_dim: int, dropout_p: float = 0.0) -> str:
    """``flex`` on CUDA (head dim up to 256, no attention dropout), else ``per_document`` (module docstring)."""
    if torch.device(device).type == "cuda" and dropout_p == 0.0 and head_dim <= _FLEX_MAX_HEAD_DIM:
        return "flex"
    return "per_document"


def describe_document_attention(device: torch.device, *, head_dim: int, dropout_p: float = 0.0) -> str:
    """`` attention=documents (...)`` for the start-up log's ``kernels:`` line: the backend training runs."""
    backend = document_backend(device, head_dim=head_dim, dropout_p=dropout_p)
    if backend == "flex":
        return " attention=documents (FlexAttention, compiled, block mask from cu_seqlens)"
    why = ("attention dropout: FlexAttention has none" if torch.device(device).type == "cuda" and dropout_p > 0
           else f"head dim {head_dim} > {_FLEX_MAX_HEAD_DIM}" if torch.device(device).type == "cuda"
           else f"on {torch.device(device).type}")
    return f" attention=documents (per-document SDPA is_causal, {why})"


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask, *,
                       q_offset: int = 0, kv_offset: int = 0, dropout_p: float = 0.0, scale: Optional[float] = None,
                       return_lse: bool = False, backend: Optional[str] = None):
    """Causal attention within documents, without an ``s × s`` mask.

    Args:
        q: ``[b, heads, s_q, hn]``, the queries at sequence positions ``[q_offset, q_offset + s_q)``.
        k, v: ``[b, heads, s_k, hn]`` (K/V already repeated to the query heads), the keys at
            ``[kv_offset, kv_offset + s_k)``.
        mask: the micro-batch's `DocumentMask` (positions index its whole sequence).
        dropout_p: attention-probability dropout (the ``per_document`` backend draws it).
        scale: softmax scale; None = 1/sqrt(hn).
        return_lse: also return the log-sum-exp ``[b, heads, s_q]`` fp32 (natural log) of each query's
            visible scores, -inf (with output 0) where the block holds none of them.
        backend: ``flex`` | ``per_document``; None = `document_backend` for q's device.
    Returns:
        ``[b, heads, s_q, hn]`` in q's dtype (and the log-sum-exp with ``return_lse``).
    Raises:
        ValueError: an unknown backend, ``dropout_p > 0`` with ``flex``, or a block reaching past the sequence.
    """
    if q_offset + q.shape[2] > mask.seq_length or kv_offset + k.shape[2] > mask.seq_length:
        raise ValueError(f"document_attention: queries [{q_offset}, {q_offset + q.shape[2]}) and keys [{kv_offset}, "
                         f"{kv_offset + k.shape[2]}) must lie in the mask's sequence of {mask.seq_length} positions")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if backend is None:
        backend = document_backend(q.device, head_dim=q.shape[-1], dropout_p=dropout_p)
    if backend == "flex":
        if dropout_p > 0:
            raise ValueError("document_attention: the flex backend has no attention dropout; use per_document")
        block_mask = mask.block_mask(q_offset, q.shape[2], kv_offset, k.shape[2])
        if not return_lse:
            return _flex(q)(q, k, v, block_mask=block_mask, scale=scale)
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _flex(q)(q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    if backend == "per_document":
        return _per_document(q, k, v, mask, q_offset, kv_offset, dropout_p, scale, return_lse)
    raise ValueError(f"document_attention: backend must be one of {BACKENDS}, got {backend!r}")


def _flex(q: torch.Tensor):
    """flex_attention as it must run for q: traced as it is inside a compiled region (the region's graph holds
    its kernel), else its own compiled function on CUDA; eager elsewhere (a reference that materialises the
    scores: CPU tests at small s)."""
    from torch.nn.attention.flex_attention import flex_attention

    if in_compiled_region() or not q.is_cuda:
        return flex_attention
    return _compiled_flex()


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@torch.compiler.disable  # a Python loop over this micro-batch's documents: eager, not one graph per layout of them
def _per_document(q, k, v, mask: DocumentMask, q_offset: int, kv_offset: int, dropout_p: float, scale: float,
                  return_lse: bool):
    """`document_attention`'s ``per_document`` backend: each document's slice of the query block against the
    same document's keys up to the block's last query; SDPA ``is_causal`` where the two slices are the same
    positions (each document alone), the explicit fp32 softmax elsewhere (shifted blocks, ``return_lse``)."""
    b, heads, s_q, hn = q.shape
    s_k = k.shape[2]
    rows, row_lses = [], []
    for r, documents in enumerate(mask.segments()):
        parts, lses = [], []
        for start, end in documents:
            q0, q1 = max(start, q_offset), min(end, q_offset + s_q)
            if q0 >= q1:
                continue  # no query of this block in this document
            k0, k1 = max(start, kv_offset), min(end, kv_offset + s_k, q1)  # keys past the last query: never seen
            qs = q[r:r + 1, :, q0 - q_offset:q1 - q_offset]
            if k0 >= k1:
                parts.append(torch.zeros_like(qs))
                lses.append(torch.full((1, heads, q1 - q0), -math.inf, device=q.device))
                continue
            ks, vs = k[r:r + 1, :, k0 - kv_offset:k1 - kv_offset], v[r:r + 1, :, k0 - kv_offset:k1 - kv_offset]
            if not return_lse and (q0, q1) == (k0, k1):
                parts.append(F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p, is_causal=True,
                                                            scale=scale))
                continue
            out, lse = _shifted_causal(qs, ks, vs, q0, k0, scale, dropout_p)
            parts.append(out)
            lses.append(lse)
        rows.append(torch.cat(parts, dim=2))
        if return_lse:
            row_lses.append(torch.cat(lses, dim=2))
    out = torch.cat(rows, dim=0)
    return (out, torch.cat(row_lses, dim=0)) if return_lse else out


def _shifted_causal(qs, ks, vs, q0: int, k0: int, scale: float, dropout_p: float):
    """Queries at positions ``q0 + i`` against keys at ``k0 + j`` (one document), key <= query; scores and
    softmax in fp32. Returns the output in qs's dtype and the log-sum-exp ``[1, heads, nq]``."""
    nq, nk = qs.shape[2], ks.shape[2]
    scores = torch.matmul(qs.float(), ks.float().transpose(-1, -2)) * scale  # [1, heads, nq, nk]
    later = (torch.arange(k0, k0 + nk, device=qs.device)[None, :]
             > torch.arange(q0, q0 + nq, device=qs.device)[:, None])
    scores = scores.masked_fill(later, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a query that sees no key of the block
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # such a query: 0 instead of nan
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    return torch.matmul(probs, vs.float()).to(qs.dtype), lse
