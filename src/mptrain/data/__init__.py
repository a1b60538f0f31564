"""Data: tokenizers, preprocessing, indexed datasets, GPTDataset, blends, mock data, sampler.

The trainer uses `build_tokenizer`, `check_vocab_size` and `build_provider` (docs/COMPONENTS.md
"Dataset provider" and "Tokenizer", docs/ARCHITECTURE.md "Batch").
"""

from mptrain.data.errors import DataError
from mptrain.data.provider import DatasetProvider, build_provider
from mptrain.data.tokenizers import Tokenizer, TokenizerProtocol, build_tokenizer, check_vocab_size

__all__ = ["DataError", "DatasetProvider", "Tokenizer", "TokenizerProtocol", "build_provider", "build_tokenizer",
           "check_vocab_size"]
