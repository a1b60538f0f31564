"""Schema of the `data` config group (DESIGN.md §1)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional


@dataclasses.dataclass
class DataConfig:
    name: str = "mock"
    """mock | indexed | shakespeare."""
    seed: int = 1234
    """Sample order (separate from train.seed)."""
    split: str = "969,30,1"
    """train,valid,test weights over document ranges."""
    prefixes: List[Any] = dataclasses.field(default_factory=list)
    """indexed: [prefix, ...] or [weight, prefix, weight, prefix, ...] for a blend."""
    tokenizer: Any = dataclasses.field(
        default_factory=lambda: {"_target_": "mptrain.data.tokenizers.NullTokenizer", "vocab_size": 1000}
    )
    """A registered tokenizer (`_target_`)."""
    vocab_size: int = 1000
    """mock: ids are below this."""
    cache_dir: Optional[str] = None
    """Where index caches go; null = beside the data."""
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 0
