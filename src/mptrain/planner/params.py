"""Parameter elements one rank holds for a layout, by formula (no model built).

Mirrors what `mptrain.layers.gpt.build_model_chunks` allocates on the rank with coordinates
(tp_rank, pp_rank): its transformer layers (all virtual chunks), the word + position embedding on
the first stage, the final norm and the output layer on the last stage. Unlike
`mptrain.layers.params.count_parameters` (a whole-model count), this is a *per-rank* count that
includes what the rank really allocates: the padded vocabulary rows (V_pad/tp, V_pad a multiple
of make_vocab_size_divisible_by × tp) and, with a tied embedding and pp > 1, the last stage's copy
of the word embedding (Megatron-LM megatron/core/models/common/language_module/language_module.py).

Per-layer elements (weights, biases, norms split or replicated over TP) come from
`mptrain.layers.params.layer_params`, the one home of the per-layer count. MoE layers: each
expert-parallel rank holds E/ep of the experts, each split over ETP (`layer_expert_params`); those
elements are counted apart (``expert_numel``) because their grads reduce, and ZeRO-1 shards them,
over the expert-data-parallel group rather than the data-parallel one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mptrain.layers.embedding import padded_vocab_size, vocab_range
from mptrain.layers.gpt import pipeline_layer_ranges
from mptrain.layers.params import layer_expert_params, layer_params, norm_params


@dataclasses.dataclass(frozen=True)
class RankParams:
    """Parameter elements of one rank.

    Attributes:
        numel: elements allocated (padding and the tied copy included): weights, grad buffer and,
            without ZeRO-1, main params / optimizer state are this many elements.
        num_params: layout.json's `num_params` convention (padding rows and the tied copy excluded).
        layers: global layer indices held (all virtual chunks), sorted.
        has_embedding: first stage (word embedding lives here).
        has_output: last stage (final norm, output layer / tied copy, cross entropy).
        expert_numel: of ``numel``, the routed experts' elements (expert-parallel weights; 0 for a dense model).
    """

    numel: int
    num_params: int
    layers: tuple
    has_embedding: bool
    has_output: bool
    expert_numel: int = 0

    @property
    def dense_numel(self) -> int:
        """Elements whose grads reduce over the data-parallel group: ``numel`` less ``expert_numel``."""
        return self.numel - self.expert_numel


def stage_layers(m, parallel, *, pp_rank: int) -> tuple:
    """Global layer indices of pipeline rank ``pp_rank`` (all its virtual chunks), sorted."""
    ranges = pipeline_layer_ranges(
        m.num_layers,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
        parallel.decoder_first_pipeline_num_layers,
        parallel.decoder_last_pipeline_num_layers,
    )[pp_rank]
    return tuple(sorted(i for chunk in ranges for i in chunk))


def rank_params(m, parallel, *, vocab_size: int, pp_rank: int, tp_rank: int = 0) -> RankParams:
    """Parameter elements of the rank at (tp_rank, pp_rank) of the layout ``parallel``.

    Args:
        m: ModelConfig. parallel: ParallelConfig (tp, pp, vpp, uneven split keys, expert_model_parallel_size,
            expert_tensor_parallel_size).
        vocab_size: V, unpadded (``model.vocab_size`` or the tokenizer's).
        pp_rank, tp_rank: the rank's coordinates (tp_rank only matters for the valid vocab rows).
    Raises:
        ConfigError: the layer split is invalid (`pipeline_layer_ranges`).
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    h = m.hidden_size
    layers = stage_layers(m, parallel, pp_rank=pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    v_pad = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp)
    start, end = vocab_range(v_pad, tp_rank, tp)
    rows_alloc, rows_valid = end - start, max(0, min(end, vocab_size) - start)
    etp = parallel.expert_tensor_parallel_size or tp  # MoE layers: experts split over etp (null: tp)
    ep = parallel.expert_model_parallel_size  # ... and E/ep of them on this rank
    numel = counted = sum(layer_params(m, tp=tp, layer_number=n, etp=etp, ep=ep) for n in layers)
    experts = sum(layer_expert_params(m, layer_number=n, etp=etp, ep=ep) for n in layers)
    if first:
        pos = (m.max_position_embeddings or m.seq_length) * h if m.position_embedding_type == "learned_absolute" else 0
        numel += rows_alloc * h + pos
        counted += rows_valid * h + pos
    if last:
        numel += norm_params(m)
        counted += norm_params(m)
        if m.untie_embeddings_and_output_weights:
            numel += rows_alloc * h
            counted += rows_valid * h
        elif pp > 1:  # the tied embedding's copy on the last stage: allocated, not counted (a replica)
            numel += rows_alloc * h
    return RankParams(numel=numel, num_params=counted, layers=layers, has_embedding=first, has_output=last,
                      expert_numel=experts)


def all_rank_params(m, parallel, *, vocab_size: int, tp_rank: int = 0) -> list:
    """`rank_params` for every pipeline rank, index = pp_rank."""
    return [rank_params(m, parallel, vocab_size=vocab_size, pp_rank=r, tp_rank=tp_rank)
            for r in range(parallel.pipeline_model_parallel_size)]


def vpp_or_one(vpp: Optional[int]) -> int:
    return vpp if vpp and vpp > 1 else 1
