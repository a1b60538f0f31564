"""Incremental decoding of a GPT chunk with a KV cache, and the sampling rules.

Legend: tokens ``[b, s]``; activations ``[s, b, h]`` (the model's layout; no sequence parallelism
at inference); ``V`` the unpadded vocabulary, ``V_pad`` padded.

`cached_forward` runs the model's own modules in `GPTModel.forward`'s order (embedding, each
`TransformerLayer.forward`, final norm, output layer; TP collectives included), handing each
layer its `LayerKVCache` (`mptrain.layers.kv_cache`): `SelfAttention.forward` applies RoPE at the
absolute positions, appends the new K / V and attends over the cached ones, so a new token costs
one position instead of the whole prefix (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", §2). For layer classes other than the shipped `TransformerLayer` with `SelfAttention`
(whose forward may not take a cache) `supports_kv_cache` is False and `mptrain.generate`
recomputes the prefix per token with the model's forward; the test checks cached == uncached logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from mptrain.layers.kv_cache import KVCache, LayerKVCache

__all__ = ["KVCache", "LayerKVCache", "cached_forward", "filter_logits", "gather_vocab", "sample_next",
           "supports_kv_cache"]


def supports_kv_cache(model) -> bool:
    """Whether every layer is exactly the shipped TransformerLayer / SelfAttention (their forward takes the
    cache; a user's subclass may not), and first and last stage are one chunk (pp = 1) without SP."""
    from mptrain.layers.attention import SelfAttention
    from mptrain.layers.transformer import TransformerLayer

    if not (model.pre_process and model.post_process) or model.sequence_parallel:
        return False
    return all(type(layer) is TransformerLayer and type(layer.self_attention) is SelfAttention
               for layer in model.decoder.layers.values())


@torch.no_grad()
def cached_forward(model, tokens: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
    """Logits ``[b, s, V_pad/tp]`` of ``tokens`` ``[b, s]`` at positions ``start ..``; fills the cache.

    The model must be in eval mode (no dropout) and `supports_kv_cache`. Positions from ``start`` on
    are (over)written in the cache.
    """
    b, s = tokens.shape
    cache.seek(start)
    positions = torch.arange(start, start + s, device=tokens.device).unsqueeze(0).expand(b, s)
    x = model.embedding(tokens, positions)  # [s, b, h]
    for n, layer in model.decoder.layers.items():
        x = layer(x, None, kv_cache=cache.layers[n])
    x = model.decoder.final_layernorm(x)
    logits = model.output_layer(x, model.output_weight())  # [s, b, V_pad/tp]
    return logits.transpose(0, 1)


def gather_vocab(logits: torch.Tensor, groups, vocab_size: int) -> torch.Tensor:
    """``[b, V_pad/tp]`` vocab-parallel logits → ``[b, V]`` fp32, the padded rows dropped (all-gather over TP)."""
    logits = logits.float().contiguous()
    if groups.tp_size > 1:
        parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
        torch.distributed.all_gather(parts, logits, group=groups.tp_group)
        logits = torch.cat(parts, dim=-1)  # shards are contiguous vocab ranges in rank order
    return logits[..., :vocab_size]


# --- sampling -------------------------------------------------------------------------------------
def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``[b, V]`` logits with the excluded tokens set to -inf.

    top_k > 0 keeps the k largest logits (ties at the k-th value all kept); top_p < 1 keeps the
    smallest set of most probable tokens whose probability sums to at least top_p (the nucleus,
    Holtzman et al. 2020 §3.1): token i in descending order is kept iff the mass before it is
    < top_p, so the most probable token is always kept. top_k applies first, then top_p on what is
    left (as in `transformers`).
    """
    out = logits.clone()
    if top_k and top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # [b, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token ``[b]`` int64 from ``[b, V]`` fp32 logits.

    temperature 0: greedy (argmax, the lowest id on ties, as ``torch.argmax``); otherwise a draw
    from softmax(filter_logits(logits / temperature)) with ``generator`` (CPU; the seed makes it
    reproducible on any device).
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits.float().cpu() / temperature, top_k=top_k, top_p=top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)
