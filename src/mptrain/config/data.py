"""Schema of the `data` config group (DESIGN.md §1; implementation in `mptrain/data/`)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional


@dataclasses.dataclass
class DataConfig:
    name: str = "mock"
    """mock | indexed | shakespeare (a registry in `mptrain.data.provider.SOURCES`)."""
    seed: int = 1234
    """Sample order (separate from train.seed): the per-epoch shuffles and the mock starts."""
    split: str = "969,30,1"
    """train,valid,test weights over document ranges (Megatron's rounding); a split may be empty."""
    prefixes: List[Any] = dataclasses.field(default_factory=list)
    """indexed: [prefix, ...] (equal weights) or [weight, prefix, weight, prefix, ...] for a blend;
    a prefix is the preprocessing --output-prefix (files PREFIX.bin + PREFIX.idx)."""
    tokenizer: Optional[Any] = None
    """A registered tokenizer: {_target_: mptrain.data.tokenizers.<ByteTokenizer | HFTokenizer |
    TiktokenTokenizer | NullTokenizer>, **args}; null = the option's default (mock: NullTokenizer
    of data.vocab_size; shakespeare: ByteTokenizer; indexed: required)."""
    vocab_size: int = 1000
    """mock: ids are below this (and the default NullTokenizer has this size)."""
    corpus: Optional[str] = None
    """shakespeare: the JSONL(.gz) to preprocess; null = the shipped data/shakespeare.jsonl.gz."""
    cache_dir: Optional[str] = None
    """Preprocessed data (shakespeare) and index caches; null = beside the data (indexed:
    <prefix dir>/mptrain_index_cache/; shakespeare: <repo>/data/cache/)."""
    reset_position_ids: bool = False
    """Position ids restart at 0 after each EOD."""
    reset_attention_mask: bool = False
    """Tokens after an EOD do not attend across it (the batch then carries a [b,1,s,s] mask)."""
    eod_mask_loss: bool = False
    """No loss where the input token is EOD (Megatron's rule)."""
