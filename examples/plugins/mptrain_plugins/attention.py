"""A user's attention core, written in plain torch against `mptrain.layers.attention.CoreAttention`.

Select it from the command line (no mptrain code changes)::

    python train.py model.transformer_layer.submodules.self_attention.submodules.core_attention._target_=mptrain_plugins.attention.SlidingWindowAttention
    # its own keyword (a key the schema does not have, so `+`):
    python train.py ...core_attention._target_=mptrain_plugins.attention.SlidingWindowAttention \
        +model.transformer_layer.submodules.self_attention.submodules.core_attention.window=16

context = softmax(Q Kᵀ / √hn + mask) · V, with mask = causal (or the batch's ``attention_mask``: its
documents' dense form when it is a `mptrain.layers.document_mask.DocumentMask`) and,
when ``window`` is set, also every key more than ``window - 1`` positions behind the query
(sliding-window attention, Beltagy et al. 2020 "Longformer" §3.1; Mistral 7B). ``window=None``
is exact causal attention, equal to the built-in core within fp32 rounding.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from mptrain.layers.document_mask import DocumentMask


class SlidingWindowAttention(torch.nn.Module):
    """Explicit softmax(QKᵀ/√d + mask)·V on this TP rank's heads (no fused kernel).

    Args:
        config: the model config (attention_dropout).
        context: the layer-construction context (`mptrain.layers.context.LayerContext`); this core
            reads ``context.sequence_parallel`` for dropout inside the TP region (the interface's rule),
            a core with parameters would take ``context.params_dtype`` / ``context.device`` / ``context.init``.
        rng_tracker: the runtime's RNG streams (``rng_tracker.fork()``: the TP region's stream).
        window: keys per query (the query's own position included); None = full causal.
    """

    def __init__(self, *, config, context, rng_tracker=None, window: Optional[int] = None) -> None:
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be >= 1 or null")
        self.window, self.dropout_p = window, config.attention_dropout
        self.sequence_parallel, self.rng_tracker = context.sequence_parallel, rng_tracker

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """query ``[s, b, np/tp, hn]``, key / value ``[s, b, ng/tp, hn]`` -> context ``[s, b, np/tp · hn]``."""
        s, b, heads, hn = query.shape
        rep = heads // key.shape[2]  # grouped-query attention: query head i reads K/V group i // rep
        q = query.permute(1, 2, 0, 3)  # [b, np/tp, s, hn]
        k = key.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hn)  # [b, np/tp, s, s]
        pos = torch.arange(s, device=q.device)
        behind = pos[:, None] - pos[None, :]  # query index - key index
        masked = behind < 0  # causal: no future keys
        if self.window is not None:
            masked = masked | (behind >= self.window)
        if isinstance(attention_mask, DocumentMask):  # data.reset_attention_mask: documents as offsets
            attention_mask = attention_mask.dense()  # an explicit core takes the s × s form
        if attention_mask is not None:  # [b, 1, s, s] bool, True = masked (already causal)
            masked = masked | attention_mask
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
        p = self.dropout_p if self.training else 0.0
        if p > 0:  # inside the TP region: the model-parallel RNG stream, unless SP already forked it
            with self.rng_tracker.fork() if not self.sequence_parallel else contextlib.nullcontext():
                probs = torch.nn.functional.dropout(probs, p, training=True)
        context = torch.matmul(probs, v)  # [b, np/tp, s, hn]
        return context.permute(2, 0, 1, 3).reshape(s, b, heads * hn)  # [s, b, np/tp · hn]
