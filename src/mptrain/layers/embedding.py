"""Vocabulary-parallel word embedding, learned position embedding, and the GPT input embedding.

Legend: token ids ``[b, s]``; activations ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
parallelism). ``V`` = unpadded vocabulary, ``V_pad`` = padded vocabulary (`padded_vocab_size`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from mptrain.layers.context import LayerContext
from mptrain.layers.mappings import reduce_from_tp_region, scatter_to_sequence_parallel_region
from mptrain.layers.random import dropout_slice, in_compiled_region
from mptrain.layers.sharding import ShardSpec, take_shard


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """V_pad = ceil(V / (d · tp)) · (d · tp) (Megatron ``training/vocab_utils.py``)."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def vocab_range(vocab_size_padded: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """[start, end) of the padded vocab rows held by ``tp_rank``."""
    per = vocab_size_padded // tp
    return tp_rank * per, (tp_rank + 1) * per


def vocab_shard_spec(vocab_size: int, hidden_size: int, vocab_size_padded: int, groups, **flags) -> ShardSpec:
    """Spec of a ``[V_pad/tp, h]`` vocab shard: offset into the unpadded [V, h] tensor, real rows."""
    start, end = vocab_range(vocab_size_padded, groups.tp_rank, groups.tp_size)
    valid = max(0, min(end, vocab_size) - start)
    return ShardSpec(global_shape=(vocab_size, hidden_size), partition_dim=0, offset=min(start, vocab_size),
                     valid=valid, **flags)


class VocabParallelEmbedding(torch.nn.Module):
    """Word embedding with rows split over TP: rank r holds padded rows [r V_pad/tp, (r+1) V_pad/tp).

    The layout-independent weight is the unpadded ``[V, h]`` normal tensor; padded rows are zero
    (and stay zero: no id selects them and the output layer masks them out of the softmax).
    Forward: ids outside this rank's range look up row 0 and are zeroed, then the partial
    embeddings are summed over TP (g). Output ``[s, b, h]`` (the ids are transposed).

    Args:
        vocab_size: V (unpadded). hidden_size: h. context: `LayerContext` (groups, init, params_dtype,
            device). make_vocab_size_divisible_by: d.
        name: global parameter prefix. tied: this weight is also the output layer (spec flag).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, context: LayerContext, name: str,
                 make_vocab_size_divisible_by: int = 128, tied: bool = False) -> None:
        super().__init__()
        groups, init = context.groups, context.init
        self.groups, self.vocab_size = groups, vocab_size
        self.vocab_size_padded = padded_vocab_size(vocab_size, make_vocab_size_divisible_by, groups.tp_size)
        self.vocab_start, self.vocab_end = vocab_range(self.vocab_size_padded, groups.tp_rank, groups.tp_size)
        # the input embedding: its own LR schedule under optim.decoupled_lr (Megatron's is_embedding_or_output_parameter)
        self._spec = vocab_shard_spec(vocab_size, hidden_size, self.vocab_size_padded, groups, tied_embedding=tied,
                                      embedding_or_output=True)
        full = init.normal(f"{name}.weight", (vocab_size, hidden_size))
        w = take_shard(full, self._spec, self.vocab_end - self.vocab_start)
        self.weight = torch.nn.Parameter(w.to(device=context.device, dtype=context.params_dtype))

    def local_shard_specs(self) -> dict:
        return {"weight": self._spec}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] int64 -> [s, b, h] (summed over TP, replicated)."""
        ids = input_ids.t()  # [s, b]: the project-wide sequence-first layout
        if self.groups.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.groups.tp_group)


class GPTEmbedding(torch.nn.Module):
    """word (vocab-parallel) + learned absolute position embedding, then dropout (Megatron ``LanguageModelEmbedding``).

    Output ``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism (scattered after the
    sum; the scatter's backward all-gathers, so the position embedding's grad is complete on
    every TP rank and needs no extra reduction). Dropout: outside SP in the default RNG (same
    mask on every TP rank, the activation is replicated); under SP inside the model-parallel
    fork (each rank holds a different sequence slice); in a compiled region its slice of a mask drawn
    over the whole sequence (`mptrain.layers.random.dropout_slice`). The position embedding is replicated.

    Args:
        config: ModelConfig. context: `LayerContext` (groups, init, sequence_parallel, params_dtype, device).
        vocab_size: V (unpadded). rng_tracker: RNGStatesTracker.
    """

    def __init__(self, config, context: LayerContext, *, vocab_size: int, rng_tracker) -> None:
        super().__init__()
        self.groups, self.sequence_parallel, self.rng_tracker = context.groups, context.sequence_parallel, rng_tracker
        self.dropout_p = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, context=context, name="embedding.word_embeddings",
            make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
            tied=not config.untie_embeddings_and_output_weights)
        if config.position_embedding_type == "learned_absolute":
            max_pos = config.max_position_embeddings or config.seq_length
            full = context.init.normal("embedding.position_embeddings.weight", (max_pos, config.hidden_size))
            self.position_embeddings = torch.nn.Embedding(max_pos, config.hidden_size, device=context.device,
                                                          dtype=context.params_dtype)
            with torch.no_grad():
                self.position_embeddings.weight.copy_(full)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """input_ids, position_ids [b, s] -> [s(/tp), b, h]."""
        x = self.word_embeddings(input_ids)  # [s, b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            x = x + self.position_embeddings(position_ids.t())  # [s, b|1, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.groups.tp_group)  # [s/tp, b, h]
        if self.dropout_p > 0 and self.training and in_compiled_region():  # no fork in a graph: layers/random.py
            index, parts = (self.groups.tp_rank, self.groups.tp_size) if self.sequence_parallel else (0, 1)
            x = dropout_slice(x, self.dropout_p, dim=0, index=index, parts=parts)
        elif self.dropout_p > 0 and self.training:
            ctx = self.rng_tracker.fork() if self.sequence_parallel else contextlib.nullcontext()
            with ctx:
                x = F.dropout(x, self.dropout_p, training=True)
        return x
