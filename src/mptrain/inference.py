"""Incremental decoding of a GPT chunk with a KV cache, and the sampling rules.

Legend: tokens ``[b, s]``; activations ``[s, b, h]`` (the model's layout; no sequence parallelism
at inference); ``np`` / ``ng`` query / K-V heads, ``hn`` head dim, ``tp`` TP size; ``V`` the
unpadded vocabulary, ``V_pad`` padded.

`cached_forward` runs the *same modules* as `GPTModel.forward` (embedding, each layer's norms,
``linear_qkv``, ``linear_proj``, MLP, final norm, output layer; TP collectives included) but
keeps each layer's K and V of earlier positions in a `KVCache`, so a new token costs one position
instead of the whole prefix (Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2).
It only knows the shipped layer (`TransformerLayer` with `SelfAttention`): for any other layer
class `supports_kv_cache` is False and `mptrain.generate` recomputes the prefix per token with the
model's own forward. The attention math mirrors `SelfAttention.forward` (fused QKV split per query
group, RoPE in fp32, GQA by ``repeat_interleave``); the test checks cached == uncached logits.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class KVCache:
    """Per layer (global index) K and V ``[b, ng/tp, max_len, hn]``; ``length`` positions filled."""

    keys: dict
    values: dict
    length: int = 0

    @classmethod
    def empty(cls, model, *, batch_size: int, max_len: int) -> "KVCache":
        keys, values = {}, {}
        for n, layer in model.decoder.layers.items():
            attn = layer.self_attention
            w = attn.linear_qkv.weight
            shape = (batch_size, attn.ng_local, max_len, attn.hn)
            keys[n] = torch.zeros(shape, dtype=w.dtype, device=w.device)
            values[n] = torch.zeros(shape, dtype=w.dtype, device=w.device)
        return cls(keys, values)


def supports_kv_cache(model) -> bool:
    """Whether every layer is exactly the shipped TransformerLayer / SelfAttention (a user's subclass may
    change the math, so it is not assumed); first and last stage in one chunk (pp = 1)."""
    from mptrain.layers.attention import SelfAttention
    from mptrain.layers.transformer import TransformerLayer

    if not (model.pre_process and model.post_process) or model.sequence_parallel:
        return False
    return all(type(layer) is TransformerLayer and type(layer.self_attention) is SelfAttention
               for layer in model.decoder.layers.values())


def _attention_step(attn, x: torch.Tensor, cache: KVCache, n: str, start: int) -> torch.Tensor:
    """`SelfAttention.forward` for positions ``start .. start+s-1`` given the cached earlier K / V."""
    from mptrain.layers.attention import apply_rope, rope_cos_sin

    qkv, _ = attn.linear_qkv(x)  # [s, b, ng/tp · (np/ng + 2) · hn]
    s, b = qkv.shape[:2]
    qkv = qkv.view(s, b, attn.ng_local, attn.np // attn.ng + 2, attn.hn)
    q = qkv[:, :, :, :-2].reshape(s, b, attn.np_local, attn.hn)  # [s, b, np/tp, hn]
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [s, b, ng/tp, hn]
    if attn.rope:
        cos, sin = rope_cos_sin(start + s, attn.hn, attn.rotary_base, x.device)
        cos, sin = cos[start:], sin[start:]  # the new positions' angles
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    end = start + s
    cache.keys[n][:, :, start:end] = k.permute(1, 2, 0, 3)  # [b, ng/tp, s, hn]
    cache.values[n][:, :, start:end] = v.permute(1, 2, 0, 3)
    rep = attn.np_local // attn.ng_local
    keys = cache.keys[n][:, :, :end].repeat_interleave(rep, dim=1)  # [b, np/tp, end, hn]
    values = cache.values[n][:, :, :end].repeat_interleave(rep, dim=1)
    # query i (absolute start + i) sees keys 0 .. start + i (True = attend)
    allowed = torch.ones(s, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
    context = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), keys, values, attn_mask=allowed)
    context = context.permute(2, 0, 1, 3).reshape(s, b, attn.np_local * attn.hn)  # [s, b, np/tp · hn]
    out, _ = attn.linear_proj(context)  # row-parallel: all-reduced over TP, bias added
    return out


@torch.no_grad()
def cached_forward(model, tokens: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
    """Logits ``[b, s, V_pad/tp]`` of ``tokens`` ``[b, s]`` at positions ``start ..``; fills the cache.

    The model must be in eval mode (no dropout) and `supports_kv_cache`.
    """
    b, s = tokens.shape
    positions = torch.arange(start, start + s, device=tokens.device).unsqueeze(0).expand(b, s)
    x = model.embedding(tokens, positions)  # [s, b, h]
    for n, layer in model.decoder.layers.items():
        x = x + _attention_step(layer.self_attention, layer.input_layernorm(x), cache, n, start)
        x = x + layer.mlp(layer.pre_mlp_layernorm(x))
    x = model.decoder.final_layernorm(x)
    cache.length = start + s
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
