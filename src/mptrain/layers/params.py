"""Parameter counts of a GPT config, by formula (no model built).

Two conventions:

``"real"``: what `build_model_chunks` creates, summed over all ranks, vocab padding excluded and
the tied embedding counted once (the last stage's copy is a replica) — equals Σ numel of the
params whose `ShardSpec.counts_on` holds, over every rank of one DP replica, minus padded rows.

``"design_doc"``: the design document's worked example (`seed_2.8b`: 12 layers, h 4096, 8 heads,
V 50257 → 2,827,821,056): per layer QKV 3h² + projection h² + MLP 8h² + two LayerNorms 2·2h
= 12h² + 4h; untied input and output embeddings 2·V·h; no linear biases, no position
embedding, no final norm, unpadded vocab. Attention / MLP widths follow the config (GQA,
kv_channels, ffn_hidden_size, SwiGLU), so for the example's shape it is exactly the formula.
"""

from __future__ import annotations

from mptrain.errors import ConfigError
from mptrain.layers.embedding import padded_vocab_size

CONVENTIONS = ("real", "design_doc")


def _layer_linear_weights(cfg) -> int:
    h, np_ = cfg.hidden_size, cfg.num_attention_heads
    ng = cfg.num_query_groups or np_
    hn = cfg.kv_channels or h // np_
    ffn = cfg.ffn_hidden_size or 4 * h
    parts = 2 if cfg.activation == "swiglu" else 1
    return h * (np_ + 2 * ng) * hn + np_ * hn * h + h * parts * ffn + ffn * h


def _layer_linear_biases(cfg) -> int:
    h, np_ = cfg.hidden_size, cfg.num_attention_heads
    ng = cfg.num_query_groups or np_
    hn = cfg.kv_channels or h // np_
    ffn = cfg.ffn_hidden_size or 4 * h
    parts = 2 if cfg.activation == "swiglu" else 1
    return (np_ + 2 * ng) * hn + h + parts * ffn + h


def _norm(cfg) -> int:
    return 2 * cfg.hidden_size if cfg.normalization == "LayerNorm" else cfg.hidden_size


def count_parameters(model_cfg, *, vocab_size: int, convention: str = "real", tp: int = 1,
                     include_padding: bool = False) -> int:
    """Number of parameters of ``model_cfg`` with an unpadded vocabulary of ``vocab_size``.

    Args:
        convention: ``"real"`` or ``"design_doc"`` (module docstring).
        tp: tensor-parallel size; only matters with ``include_padding`` (V padded to
            make_vocab_size_divisible_by × tp) — the real count is otherwise layout-independent.
        include_padding: count the padded vocabulary rows ("real" only).
    Raises:
        ConfigError: unknown convention.
    """
    if convention not in CONVENTIONS:
        raise ConfigError(f"count_parameters: convention={convention!r} is not one of {list(CONVENTIONS)}")
    h, L = model_cfg.hidden_size, model_cfg.num_layers
    if convention == "design_doc":
        return L * (_layer_linear_weights(model_cfg) + 2 * 2 * h) + 2 * vocab_size * h
    v = padded_vocab_size(vocab_size, model_cfg.make_vocab_size_divisible_by, tp) if include_padding else vocab_size
    per_layer = _layer_linear_weights(model_cfg) + 2 * _norm(model_cfg)
    if model_cfg.add_bias_linear:
        per_layer += _layer_linear_biases(model_cfg)
    total = L * per_layer + _norm(model_cfg) + v * h  # layers, final norm, word embedding
    if model_cfg.position_embedding_type == "learned_absolute":
        total += (model_cfg.max_position_embeddings or model_cfg.seq_length) * h
    if model_cfg.untie_embeddings_and_output_weights:
        total += v * h
    return total
