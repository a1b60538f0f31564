"""Key / value cache for incremental decoding (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", §2): each layer keeps the K and V of the positions already processed, so a new token
costs one position instead of the whole prefix.

Legend: ``s`` new positions, ``b`` batch, ``ng`` K/V heads (query groups), ``hn`` head dim, ``tp``
TP size. Buffers are ``[max_len, b, ng/tp, hn]``: the attention layout ``[s, b, heads, hn]`` of
`SelfAttention`, so the filled prefix ``[:end]`` is a plain slice that goes to the core attention
like a full-sequence key.

`SelfAttention.forward(x, kv_cache=layer_cache)` takes one `LayerKVCache`; `KVCache` holds one per
layer of a model chunk, keyed by the global layer index (``decoder.layers.<n>``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class LayerKVCache:
    """One layer's cache: ``keys`` / ``values`` ``[max_len, b, ng/tp, hn]``; positions ``0 .. length-1`` filled.

    ``length`` is also the position of the next token: the layer's forward reads it for RoPE and
    the causal mask, then advances it.
    """

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple:
        """Store ``key`` / ``value`` ``[s, b, ng/tp, hn]`` at positions ``length .. length+s-1``.

        Returns:
            (keys, values, attention_mask): every filled position's K and V ``[length+s, b, ng/tp, hn]``
            and the causal mask ``[1, 1, s, length+s]`` bool, True = masked (new position i, absolute
            ``length + i``, sees keys ``0 .. length + i``), in the core attention's convention.
        Raises:
            ValueError: the cache has no room for ``s`` more positions.
        """
        start, s = self.length, key.shape[0]
        end = start + s
        if end > self.keys.shape[0]:
            raise ValueError(f"KV cache holds {self.keys.shape[0]} positions; {start} filled + {s} new exceed it")
        self.keys[start:end] = key
        self.values[start:end] = value
        self.length = end
        allowed = torch.ones(s, end, dtype=torch.bool, device=key.device).tril(diagonal=start)
        return self.keys[:end], self.values[:end], ~allowed[None, None]


@dataclasses.dataclass
class KVCache:
    """The caches of a model chunk's layers: ``layers[n]`` for global layer index ``n`` (a string, as
    in ``decoder.layers``); ``length`` positions filled."""

    layers: dict

    @property
    def length(self) -> int:
        """Positions filled (the same in every layer after a forward)."""
        return next(iter(self.layers.values())).length if self.layers else 0

    @classmethod
    def empty(cls, model, *, batch_size: int, max_len: int) -> "KVCache":
        """Zero buffers for every layer of ``model`` (a `GPTModel` chunk of `SelfAttention` layers), in the
        dtype and on the device of each layer's QKV weight."""
        layers = {}
        for n, layer in model.decoder.layers.items():
            attn = layer.self_attention
            w = attn.linear_qkv.weight
            shape = (max_len, batch_size, attn.ng_local, attn.hn)
            layers[n] = LayerKVCache(torch.zeros(shape, dtype=w.dtype, device=w.device),
                                     torch.zeros(shape, dtype=w.dtype, device=w.device))
        return cls(layers)

    def seek(self, position: int) -> None:
        """Make ``position`` the next position of every layer (later ones are overwritten)."""
        for layer in self.layers.values():
            layer.length = position
