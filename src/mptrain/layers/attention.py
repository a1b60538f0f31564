"""Causal self-attention with heads split over TP, grouped-query attention and RoPE.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``np`` query heads, ``ng`` query groups
(K/V heads; ng = np for multi-head attention), ``hn`` head dim (kv_channels), ``tp`` TP size.
Activations ``[s, b, h]`` (``[s/tp, b, h]`` in/out under sequence parallelism).

Fused QKV layout (the layout-independent global weight, Megatron's ``linear_qkv``): rows
``[(np + 2 ng) · hn, h]`` ordered by query group g = 0..ng-1, each group one block
``[q_{g,0}, ..., q_{g,np/ng-1}, k_g, v_g]`` of ``hn`` rows per head. TP rank r holds the
contiguous groups ``[r·ng/tp, (r+1)·ng/tp)``, i.e. a plain contiguous split of dim 0
(``ShardSpec.interleave = 1``), so a checkpoint maps shards by offset alone. Query head i
attends with K/V group ``i // (np/ng)`` (``repeat_interleave``).

Softmax precision: the core runs ``torch.nn.functional.scaled_dot_product_attention`` (causal,
scale 1/sqrt(hn)); its fused kernels (flash / memory-efficient on CUDA, flash on CPU) accumulate
the softmax in fp32 for fp16/bf16 inputs. The one case where SDPA falls back to a half-precision
math softmax is attention dropout off CUDA; there, with ``attention_softmax_in_fp32``, we compute
scores, mask, softmax and dropout explicitly in fp32 and cast the probabilities back before P·V
(Megatron's unfused ``DotProductAttention`` path).

Head dims above 256 (the design document's seed_2.8b: 4096 / 8 = 512) have no flash or cuDNN kernel;
SDPA then runs its memory-efficient kernel, many times slower than the GEMMs the attention needs
(bench/run_bench.py's SDPA probe; bench/reports/2026-11-30-megatron-core.md).
``model.attention_backend=auto`` therefore runs the unfused
core there (`_unfused_attention`): two batched GEMMs around a half-precision softmax that accumulates
in fp32 internally, which is what Megatron's ``FusedScaleMaskSoftmax`` computes.

Document masking (``data.reset_attention_mask`` carried as document offsets): the mask is a
`mptrain.layers.document_mask.DocumentMask` and the core runs `document_attention` (FlexAttention on CUDA,
per-document SDPA elsewhere) whatever ``model.attention_backend`` says; no ``s × s`` tensor is made.

Spec tree (``model.transformer_layer.submodules.self_attention``, kind `SELF_ATTENTION`): ``linear_qkv``
(column-parallel), ``core_attention`` (kind `CORE_ATTENTION`, interface `CoreAttention`; default
`DotProductAttention`, which reads ``model.attention_backend``), ``linear_proj`` (row-parallel), and with
``model.qk_layernorm`` ``q_layernorm`` / ``k_layernorm`` (kind `mptrain.layers.norms.NORM` over hn).

QK norm (``model.qk_layernorm``; Megatron-core ``SelfAttention``'s ``q_layernorm`` / ``k_layernorm``, Qwen3's
``q_norm`` / ``k_norm``): after the QKV split and before RoPE, each query head ``[.., hn]`` and each key head is
normalised over hn by one norm each, weights ``[hn]`` shared by all heads. The weights are replicated over TP but a
TP rank normalises only its own heads, so their grads are partial sums over TP, all-reduced as the
sequence-parallel norms' are (``ShardSpec.sequence_parallel_grad``; Megatron's ``finalize_model_grads`` does the
same for ``q_layernorm`` / ``k_layernorm``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from mptrain.components import ComponentKind
from mptrain.config.model import SelfAttentionSubmodules, recompute_granularity
from mptrain.errors import check_choice
from mptrain.layers.context import LayerContext
from mptrain.layers.context_parallel import local_positions
from mptrain.layers.cp_attention import a2a_attention, all_gather_attention, ring_attention
from mptrain.layers.document_mask import DocumentMask, document_attention
from mptrain.layers.dtypes import HALF_DTYPES
from mptrain.layers.kv_cache import LayerKVCache
from mptrain.layers.norms import NORM
from mptrain.layers.random import checkpoint, dropout_slice, in_compiled_region
from mptrain.layers.spec import (COLUMN_PARALLEL_LINEAR, ROW_PARALLEL_LINEAR, build_module, submodule,
                                 with_returned_bias)

KEY = "model.transformer_layer.submodules.self_attention"
ATTENTION_BACKENDS = ("auto", "sdpa", "unfused")
"""``model.attention_backend`` (read by `DotProductAttention`): the one table of that key."""
_FLASH_MAX_HEAD_DIM = 256  # flash-attention 2 / cuDNN SDPA support head dims up to 256


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device, *, scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[s, 1, 1, hn]`` fp32 for positions 0..s-1 (Su et al. 2021, RoFormer §3.4; Megatron's
    non-interleaved layout: frequencies repeated as [f, f] over the two halves, which is Hugging Face
    Llama's ``rotate_half`` convention, so its q / k weights load unpermuted).

    ``scaling``: a ModelConfig with ``rope_scaling`` true applies Llama 3.1's frequency scaling
    (`llama3_inv_freq`); None or rope_scaling false: plain RoPE.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if scaling is not None and scaling.rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # [s, hn/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [s, 1, 1, hn]
    return emb.cos(), emb.sin()


def llama3_inv_freq(inv_freq: torch.Tensor, model) -> torch.Tensor:
    """Llama 3.1's scaled frequencies ``[hn/2]`` (Meta's llama-models ``apply_scaling``; transformers'
    ``_compute_llama3_parameters``): wavelength 2π/f above L/low_freq_factor (L = the original context
    length) -> f / factor; below L/high_freq_factor -> f; between: (1 - a)·f/factor + a·f with
    a = (L/wavelength - low) / (high - low)."""
    factor, low, high = model.rope_scaling_factor, model.rope_scaling_low_freq_factor, model.rope_scaling_high_freq_factor
    old_len = model.rope_scaling_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotary_dim(head_dim: int, rotary_percent: float) -> int:
    """The rotated width of each head: int(head_dim × rotary_percent) (Megatron's ``RotaryEmbedding``)."""
    return int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[s, b, heads, hn]`` rotated: x·cos + rotate_half(x)·sin, computed in fp32. With cos / sin narrower
    than hn (``model.rotary_percent`` < 1: ``[.., rot]``) only the first rot dims rotate, the rest pass through
    (Megatron's ``_apply_rotary_pos_emb_bshd``: t, t_pass = t[..., :rot], t[..., rot:])."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def check_attention_backend(model) -> None:
    """``model.attention_backend`` is a built-in name. Raises ConfigError naming the key and the options."""
    check_choice("model.attention_backend", model.attention_backend, ATTENTION_BACKENDS)


class CoreAttention(Protocol):
    """The attention core of one layer, on this TP rank's heads (Megatron's ``core_attention``).

    Built as ``target(*, config, layer_number, context, rng_tracker)`` (only the keywords it accepts;
    ``context``: the chunk's `LayerContext`). ``forward(query, key, value, attention_mask) -> context``:
        query ``[s, b, np/tp, hn]``; key, value ``[s, b, ng/tp, hn]`` (RoPE already applied; query head
        i uses K/V group ``i // (np/ng)``); attention_mask ``[b, 1, s, s]`` bool, True = masked, or a
        `mptrain.layers.document_mask.DocumentMask` (``data.reset_attention_mask`` without the dense mask:
        causal within documents, `document_attention` computes it), or None for plain causal; context
        ``[s, b, np/tp · hn]`` in the input dtype, heads in query order.
    Scale 1/sqrt(hn) unless the core decides otherwise. Attention dropout (``config.attention_dropout``,
    only while ``self.training``) is inside a TP region: draw it in ``rng_tracker.fork()`` unless
    ``context.sequence_parallel`` (the trainer already runs the whole block in that fork). The trainer wraps
    the call in activation checkpointing under ``recompute_granularity=selective``; the core holds no
    parameters of its own in the default tree (any it adds are replicated over TP).
    """

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Under a KV cache (decoding) key and value are longer than the query: ``[s_k, b, ng/tp, hn]``
        with the cached positions first, and attention_mask ``[1, 1, s, s_k]`` is always given."""


CORE_ATTENTION = ComponentKind("core attention", methods=("forward",),
                               runtime_keywords=("config", "layer_number", "context", "rng_tracker"),
                               interface=CoreAttention)


class DotProductAttention(torch.nn.Module):
    """The default core: SDPA, or the unfused GEMM-softmax-GEMM core (``model.attention_backend``; module docstring).

    Args:
        config: ModelConfig (attention_dropout, attention_softmax_in_fp32, attention_backend).
        context: `LayerContext`; its ``sequence_parallel`` says the block already runs in the
            model-parallel RNG fork. rng_tracker: RNGStatesTracker. layer_number: unused (the interface's keyword).
    Raises:
        ConfigError: unknown ``model.attention_backend``.
    """

    def __init__(self, *, config, context: LayerContext, layer_number: int = 0, rng_tracker=None) -> None:
        super().__init__()
        check_attention_backend(config)
        self.attention_dropout = config.attention_dropout
        self.softmax_in_fp32 = config.attention_softmax_in_fp32
        self.attention_backend = config.attention_backend
        self.sequence_parallel, self.rng_tracker = context.sequence_parallel, rng_tracker
        self.tp_rank, self.tp_size = context.groups.tp_rank, context.groups.tp_size
        self.groups, self.cp_comm_type = context.groups, context.cp_comm_type

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """q ``[s, b, np/tp, hn]``, k, v ``[s, b, ng/tp, hn]`` -> context ``[s, b, np/tp · hn]``.

        Attention-probability dropout is inside a TP region (each rank holds other heads): it runs
        in the model-parallel RNG fork, unless sequence parallelism already put the whole block in
        that fork (megatron/core/transformer/dot_product_attention.py). In a compiled region there is
        no fork: the unfused cores drop the probabilities with this rank's heads' slice of an all-heads
        mask (`mptrain.layers.random.dropout_slice`), which is why the core is the unfused one at tp > 1;
        at tp = 1 SDPA draws its mask from the current generator inside its kernel.
        """
        s, b, np_local, hn = q.shape
        if getattr(self.groups, "cp_size", 1) > 1:  # s = s/cp tokens of each sequence: K/V live on the CP ranks
            return self._context_parallel(q, k, v, attention_mask).permute(2, 0, 1, 3).reshape(s, b, np_local * hn)
        rep = np_local // k.shape[2]
        q = q.permute(1, 2, 0, 3)  # [b, np/tp, s, hn]
        k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, ng/tp, s, hn]
        if rep > 1:  # GQA; at rep 1 repeat_interleave would only copy (two copies a layer, and their backward)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [b, np/tp, s, hn]
        dropout_p = self.attention_dropout if self.training else 0.0
        in_graph = dropout_p > 0 and in_compiled_region()
        fork = dropout_p > 0 and not self.sequence_parallel and not in_graph
        # compiled: no fork; this rank's heads' slice of a mask drawn over all heads (layers/random.py)
        drop = (functools.partial(dropout_slice, p=dropout_p, dim=1, index=self.tp_rank, parts=self.tp_size)
                if in_graph else None)
        # SDPA's kernels draw their mask inside, per local head: at tp > 1 the compiled core is the unfused one
        sliced = in_graph and self.tp_size > 1
        with self.rng_tracker.fork() if fork else contextlib.nullcontext():
            half = q.dtype in HALF_DTYPES
            if isinstance(attention_mask, DocumentMask):  # per device: FlexAttention or per-document SDPA
                out = document_attention(q, k, v, attention_mask, dropout_p=dropout_p)
            elif half and self.softmax_in_fp32 and dropout_p > 0 and q.device.type != "cuda":
                out = fp32_softmax_attention(q, k, v, attention_mask, dropout_p, drop)
            elif self._use_unfused(q) or sliced:
                out = unfused_attention(q, k, v, attention_mask, dropout_p, drop)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
                    dropout_p=dropout_p, is_causal=attention_mask is None)
        return out.permute(2, 0, 1, 3).reshape(s, b, np_local * hn)  # [s, b, np/tp · hn]

    def _context_parallel(self, q, k, v, attention_mask) -> torch.Tensor:
        """CP core (`mptrain.layers.cp_attention`): q ``[s/cp, b, np/tp, hn]``, k, v ``[s/cp, b, ng/tp, hn]`` ->
        ``[b, np/tp, s/cp, hn]``. Attention dropout is 0 here (`context_parallel.check_context_parallel`)."""
        if self.cp_comm_type == "all_gather":
            return all_gather_attention(q, k, v, self.groups, attention_mask)
        if attention_mask is not None and not isinstance(attention_mask, DocumentMask):
            raise ValueError(f"parallel.cp_comm_type={self.cp_comm_type} takes document offsets, not a dense mask; "
                             "set data.create_attention_mask_in_dataloader=false or cp_comm_type=all_gather")
        if self.cp_comm_type == "a2a":
            return a2a_attention(q, k, v, self.groups, attention_mask)
        return ring_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), self.groups,
                              documents=attention_mask)

    def _use_unfused(self, q: torch.Tensor) -> bool:
        if self.attention_backend == "auto":
            return q.is_cuda and q.dtype in HALF_DTYPES and q.shape[-1] > _FLASH_MAX_HEAD_DIM
        return self.attention_backend == "unfused"


def unfused_attention(q, k, v, attention_mask, dropout_p, drop=None):
    """GEMM, scale + mask + softmax, GEMM; inputs/outputs ``[b, heads, s, hn]`` in the model dtype.
    ``drop``: the probabilities' dropout (``probs -> probs``; default ``F.dropout`` with ``dropout_p``).

    The scores ``[b, heads, s, s]`` stay in the input dtype; torch's softmax accumulates in fp32
    for half inputs. The masked fill is in place: the Q·Kᵀ GEMM keeps its inputs, not its output.
    """
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))  # [b, heads, s, s]
    if attention_mask is None:
        attention_mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill_(attention_mask, float("-inf")), dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True) if drop is None else drop(probs)
    return torch.matmul(probs, v)


def fp32_softmax_attention(q, k, v, attention_mask, dropout_p, drop=None):
    """Unfused core with scores, softmax and dropout in fp32; inputs/outputs ``[b, heads, s, hn]``.
    ``drop``: as `unfused_attention`'s."""
    s = q.shape[2]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [b, heads, s, s]
    if attention_mask is None:
        attention_mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(attention_mask, float("-inf")), dim=-1)
    probs = F.dropout(probs, dropout_p, training=True) if drop is None else drop(probs)
    return torch.matmul(probs.to(v.dtype), v)


class SelfAttention(torch.nn.Module):
    """Column-parallel QKV -> (QK norm) -> (RoPE) -> core attention on np/tp heads -> row-parallel projection.

    Args:
        config: ModelConfig. context: `LayerContext` (groups, sequence_parallel, init, ...), handed
            to every child node. layer_number: global 0-based layer index. rng_tracker: RNGStatesTracker.
        submodules: the spec node's ``submodules`` (linear_qkv, core_attention, linear_proj); None =
            the default `mptrain.config.model.SelfAttentionSubmodules`.
    forward(x ``[s(/tp), b, h]``, attention_mask ``[b, 1, s, s]`` bool True = masked, a `DocumentMask`, or None
    for causal) -> ``[s(/tp), b, h]`` (projection bias added).
    """

    def __init__(self, config, context: LayerContext, *, layer_number: int, rng_tracker, submodules=None) -> None:
        super().__init__()
        if submodules is None:
            submodules = SelfAttentionSubmodules()
        node = {"submodules": submodules}
        groups, sequence_parallel = context.groups, context.sequence_parallel
        tp = groups.tp_size
        self.np = config.num_attention_heads
        self.ng = config.num_query_groups or self.np
        self.hn = config.kv_channels or config.hidden_size // self.np
        self.np_local, self.ng_local = self.np // tp, self.ng // tp
        self.groups, self.sequence_parallel, self.rng_tracker = groups, sequence_parallel, rng_tracker
        self.rope = config.position_embedding_type == "rope"
        self.rotary_base = config.rotary_base
        self.rotary_dim = rotary_dim(self.hn, getattr(config, "rotary_percent", 1.0))
        self.rope_scaling = config if getattr(config, "rope_scaling", False) else None  # llama3 frequency scaling
        self.recompute_core = recompute_granularity(config) == "selective"
        prefix = f"decoder.layers.{layer_number}.self_attention"
        common = dict(context=context, bias=config.add_bias_linear)
        self.linear_qkv = build_module(f"{KEY}.submodules.linear_qkv", submodule(node, "linear_qkv"),
                                       COLUMN_PARALLEL_LINEAR, input_size=config.hidden_size,
                                       output_size=(self.np + 2 * self.ng) * self.hn, name=f"{prefix}.linear_qkv",
                                       **{**common, "bias": config.add_bias_linear or config.add_qkv_bias})
        self.core_attention = build_module(f"{KEY}.submodules.core_attention", submodule(node, "core_attention"),
                                           CORE_ATTENTION, config=config, layer_number=layer_number, context=context,
                                           rng_tracker=rng_tracker)
        self.linear_proj = build_module(f"{KEY}.submodules.linear_proj", submodule(node, "linear_proj"),
                                        ROW_PARALLEL_LINEAR, input_size=self.np * self.hn, output_size=config.hidden_size,
                                        name=f"{prefix}.linear_proj", input_is_parallel=True, scaled_init=True, **common)
        self.q_layernorm = self.k_layernorm = None
        if getattr(config, "qk_layernorm", False):
            # each TP rank normalises its own heads: the replicated weights' grads are partial sums over TP, which
            # the norm's spec asks finalize_model_grads to all-reduce, as under sequence parallelism (module docstring)
            heads_split = dataclasses.replace(context, sequence_parallel=tp > 1)
            norm = dict(hidden_size=self.hn, config=config, eps=config.layernorm_epsilon, context=heads_split)
            self.q_layernorm = build_module(f"{KEY}.submodules.q_layernorm", submodule(node, "q_layernorm"), NORM, **norm)
            self.k_layernorm = build_module(f"{KEY}.submodules.k_layernorm", submodule(node, "k_layernorm"), NORM, **norm)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[LayerKVCache] = None) -> torch.Tensor:
        """x ``[s(/tp), b, h]`` -> ``[s(/tp), b, h]`` (class docstring).

        With ``kv_cache`` (incremental decoding, `mptrain.layers.kv_cache`): x holds the ``s`` positions
        after the ``kv_cache.length`` already cached ones; RoPE uses their absolute positions, their K
        and V join the cache, and the queries attend causally over every cached key.

        Raises:
            ValueError: both ``attention_mask`` and ``kv_cache`` given (the cache path is causal).
        """
        qkv = with_returned_bias(self.linear_qkv(x))  # [s, b, ng/tp · (np/ng + 2) · hn]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.ng_local, self.np // self.ng + 2, self.hn)  # per local group: q..q, k, v
        # one split (its backward is one cat) rather than three slices (three zero-filled full-size grads + adds)
        q, k, v = torch.split(qkv, [self.np // self.ng, 1, 1], dim=3)
        q = q.reshape(s, b, self.np_local, self.hn)  # [s, b, np/tp, hn]
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, ng/tp, hn]
        if self.q_layernorm is not None:  # over hn, before RoPE (Qwen3's order)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        start = 0 if kv_cache is None else kv_cache.length  # absolute position of x's first row
        if self.rope:
            cp = getattr(self.groups, "cp_size", 1)
            cos, sin = rope_cos_sin(start + s * cp, self.rotary_dim, self.rotary_base, x.device, scaling=self.rope_scaling)
            if start:
                cos, sin = cos[start:], sin[start:]  # the new positions' angles
            if cp > 1:  # this rank's two chunks of the sequence: their global positions' angles
                pos = local_positions(s * cp, cp, self.groups.cp_rank, device=x.device)
                cos, sin = cos[pos], sin[pos]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            if attention_mask is not None:
                raise ValueError("SelfAttention: attention_mask must be None with a kv_cache (the cached path is causal)")
            k, v, attention_mask = kv_cache.append(k, v)  # [start+s, b, ng/tp, hn], mask [1, 1, s, start+s]
        if self.recompute_core and torch.is_grad_enabled():
            context = checkpoint(self.core_attention, self.rng_tracker, q, k, v, attention_mask)
        else:
            context = self.core_attention(q, k, v, attention_mask)  # [s, b, np/tp · hn]
        return with_returned_bias(self.linear_proj(context))


SELF_ATTENTION = ComponentKind(
    "self attention", methods=("forward",),
    runtime_keywords=("config", "context", "layer_number", "rng_tracker", "submodules"),
    interface=SelfAttention)
