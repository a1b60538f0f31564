"""Which blocks each step of the context-parallel ring computes, and how (`cp_attention.ring_attention`).

Legend: ``cp`` ranks, rank ``r`` holds chunks r and 2·cp − 1 − r of 2·cp equal chunks of ``c`` tokens
(`context_parallel`): its ``sl = 2c`` query rows are [chunk r | chunk 2·cp − 1 − r]. At ring step i it holds the
K/V of rank j = (r − i) mod cp, whose columns are [chunk j | chunk 2·cp − 1 − j] in the same way.

A `Block` is a rectangle of those rows and columns with one kernel call: ``causal`` (a diagonal of equal
positions), ``full`` (every query sees every key) or ``masked`` (an explicit ``[b, 1, rows, cols]`` mask).

* Plain causal attention (`causal_plan`): the three cases of the `cp_attention` module docstring, one block a
  step.
* Document masking (`document_plan`, ``data.reset_attention_mask``): every CP rank holds the whole sequence's
  document boundaries (`document_mask.DocumentMask` of the batch's ``cu_seqlens``, not split over CP), so each
  (query chunk a, key chunk k) pair of a step is classified from the document ids at the chunks' ends, which
  never decrease along the sequence:
    - k > a: empty (causality);
    - k = a: ``causal`` when the chunk is one document in every sequence of the micro-batch, else masked;
    - k < a: empty when every sequence's last key lies in an earlier document than its first query (no
      query may see any key: no compute, and nothing enters the log-sum-exp merge or the backward), ``full``
      when every sequence's first key and last query share a document, else masked.
  A step whose pairs are classified as without documents is the causal plan's one block; otherwise one block
  per non-empty pair, the diagonal pairs of step 0 first (each query sees itself there, so the merged
  log-sum-exp is finite before a block that leaves a query without keys is merged). A masked block's mask is
  ``[b, 1, c, c]`` bool, True = visible: same document and key position <= query position.
The classification reads ``2 × b × 2·cp`` document ids on the host once per micro-batch (a host sync; the plan
is cached on the `DocumentMask`, so every layer, recomputation and the backward reuse it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mptrain.layers.document_mask import DocumentMask

CAUSAL, FULL, MASKED = "causal", "full", "masked"
RING_DOCUMENTS_NOTE = (" attention=documents (ring blocks from document ids: flash where whole, fp32 masked "
                       "matmuls where cut, unseen blocks skipped)")
"""The start-up log's ``kernels:`` note for document masking in the ring (``cp_comm_type=p2p``)."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One kernel call of a ring step: query ``rows`` of this rank's ``sl`` tokens, K/V ``cols`` of the held block.

    Attributes:
        rows, cols: slices of ``[0, sl)``.
        kind: ``causal`` (rows and cols are the same positions), ``full`` or ``masked``.
        visible: for ``masked``, ``[b, 1, rows, cols]`` bool, True = the query may see the key; else None.
    """

    rows: slice
    cols: slice
    kind: str
    visible: Optional[torch.Tensor] = None

    @property
    def causal(self) -> bool:
        return self.kind == CAUSAL


def causal_plan(cp: int, rank: int, sl: int) -> list:
    """``plan[step]`` = [`Block`] of plain causal ring attention on CP rank ``rank`` (``sl`` tokens a rank)."""
    half = sl // 2
    plan = []
    for step in range(cp):
        src = (rank - step) % cp
        if step == 0:  # the local chunks against themselves: causal over the 2c positions, in order
            plan.append([Block(slice(None), slice(None), CAUSAL)])
        elif src < rank:  # both query chunks are later than chunk src and earlier than chunk 2·cp − 1 − src
            plan.append([Block(slice(None), slice(0, half), FULL)])
        else:  # only the second query chunk is later, than both of src's chunks
            plan.append([Block(slice(half, None), slice(None), FULL)])
    return plan


def document_plan(mask: DocumentMask, cp: int, rank: int) -> list:
    """``plan[step]`` = [`Block`] of document-masked ring attention on CP rank ``rank`` (module docstring),
    cached on ``mask`` per (cp, rank). ``mask.seq_length`` is the whole sequence s; 2·cp divides it."""
    return mask.memo(("ring_plan", cp, rank), lambda: _document_plan(mask, cp, rank))


def _document_plan(mask: DocumentMask, cp: int, rank: int) -> list:
    s = mask.seq_length
    c = s // (2 * cp)
    doc = mask.document_ids()  # [b, s]
    # host sync, once per micro-batch: the document ids at each chunk's first and last position, [2, b, 2·cp]
    first, last = torch.stack([doc[:, ::c], doc[:, c - 1::c]]).tolist()
    kinds = {}
    for a in range(2 * cp):
        for k in range(a + 1):
            kinds[a, k] = _kind(a, k, first, last)
    halves = (slice(0, c), slice(c, 2 * c))
    plan = []
    for step in range(cp):
        src = (rank - step) % cp
        mine, held = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)  # chunk indices of the rows and the cols
        # the diagonal pairs of step 0 first (module docstring: the merge's order)
        pairs = [(0, 0), (1, 1), (1, 0), (0, 1)] if step == 0 else [(0, 0), (0, 1), (1, 0), (1, 1)]
        live = {(i, j): kinds.get((mine[i], held[j])) for i, j in pairs}  # None: nothing visible
        if all(kind == _causal_kind(mine[i], held[j]) for (i, j), kind in live.items()):
            plan.append(causal_plan(cp, rank, 2 * c)[step])  # no document boundary where this step looks
            continue
        blocks = []
        for (i, j), kind in live.items():
            if kind is not None:
                visible = _visible(doc, mine[i], held[j], c) if kind == MASKED else None
                blocks.append(Block(halves[i], halves[j], kind, visible))
        plan.append(blocks)
    return plan


def _visible(doc: torch.Tensor, a: int, k: int, c: int) -> torch.Tensor:
    """``[b, 1, c, c]`` bool: query i of chunk a may see key j of chunk k (same document, key not later)."""
    q_doc, k_doc = doc[:, a * c:(a + 1) * c], doc[:, k * c:(k + 1) * c]  # [b, c]
    q_pos = torch.arange(a * c, (a + 1) * c, device=doc.device)
    k_pos = torch.arange(k * c, (k + 1) * c, device=doc.device)
    later = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [c, c]
    return ((q_doc.unsqueeze(2) == k_doc.unsqueeze(1)) & ~later).unsqueeze(1)


def _causal_kind(a: int, k: int) -> Optional[str]:
    """The kind of chunk pair (a, k) without documents: causal on the diagonal, full below it, None above."""
    return CAUSAL if a == k else FULL if k < a else None


def _kind(a: int, k: int, first: list, last: list) -> Optional[str]:
    """The kind of query chunk a against key chunk k <= a over every sequence (module docstring); None = empty.

    ``first[r][x]``, ``last[r][x]``: the document id of chunk x's first and last position in sequence r."""
    rows = range(len(first))
    if a == k:
        return CAUSAL if all(first[r][a] == last[r][a] for r in rows) else MASKED
    if all(last[r][k] < first[r][a] for r in rows):
        return None
    if all(first[r][k] == last[r][a] for r in rows):
        return FULL
    return MASKED
