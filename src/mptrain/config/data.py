"""Schema of the `data` config group (DESIGN.md §1; implementation in `mptrain/data/`)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional


@dataclasses.dataclass
class DataConfig:
    """The `data` group: a dataset provider component (`data._target_`, docs/COMPONENTS.md "Dataset
    provider") and the shared data keys, each passed to the provider only when its `__init__` takes
    it (`mptrain.data.provider.build_provider`); a user provider's own keys are added with `+data.<key>`."""

    _target_: str = "mptrain.data.provider.MockDataProvider"
    """The provider class (or factory): mptrain.data.provider.MockDataProvider (data=mock) |
    IndexedDataProvider (data=indexed) | ShakespeareDataProvider (data=shakespeare) | a user's class."""
    name: str = "mock"
    """The option's name (mock | indexed | shakespeare): a label for summaries; it selects nothing."""
    seed: int = 1234
    """Sample order (separate from train.seed): the per-epoch shuffles and the mock starts."""
    split: Any = "969,30,1"
    """train,valid,test weights over document ranges of data.prefixes (Megatron's rounding): the
    string "969,30,1" (quote it on the command line: 'data.split="90,8,2"') or a list [90, 8, 2];
    a split may be empty. Not used with data.train_prefixes."""
    prefixes: List[Any] = dataclasses.field(default_factory=list)
    """indexed: [prefix, ...] (equal weights) or [weight, prefix, weight, prefix, ...] for a blend;
    a prefix is the preprocessing --output-prefix (files PREFIX.bin + PREFIX.idx)."""
    train_prefixes: List[Any] = dataclasses.field(default_factory=list)
    """indexed: separate training corpus (a prefix list or blend as data.prefixes), used whole instead
    of cutting data.prefixes by data.split (Megatron's --train-data-path); exclusive with data.prefixes."""
    valid_prefixes: List[Any] = dataclasses.field(default_factory=list)
    """indexed: held-out validation corpus (Megatron's --valid-data-path); empty: no valid rows.
    Needs data.train_prefixes."""
    test_prefixes: List[Any] = dataclasses.field(default_factory=list)
    """indexed: held-out test corpus (Megatron's --test-data-path); empty: no test rows."""
    tokenizer: Optional[Any] = None
    """The tokenizer component: {_target_: any class with the tokenizer interface
    (mptrain.data.tokenizers.TokenizerProtocol), **its keywords}; shipped: mptrain.data.tokenizers.
    ByteTokenizer | HFTokenizer | GPT2BPETokenizer (vocab_file, merge_file: Megatron's GPT2BPETokenizer) |
    TiktokenTokenizer | NullTokenizer. Each option's YAML sets one; null is an error."""
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
    """Tokens after an EOD do not attend across it. The batch carries the document boundaries as offsets
    (cu_seqlens [b, s+1]) and attention skips other documents' blocks (FlexAttention on CUDA, per-document
    SDPA on CPU); no [b,1,s,s] mask unless data.create_attention_mask_in_dataloader."""
    eod_mask_loss: bool = False
    """No loss where the input token is EOD (Megatron's rule)."""
    create_attention_mask_in_dataloader: bool = False
    """With reset_attention_mask: the batch carries the dense [b,1,s,s] mask instead of the offsets and
    attention runs with it (the reference path; O(s^2) memory). Megatron's key; its default is true, whose
    math is the same."""
