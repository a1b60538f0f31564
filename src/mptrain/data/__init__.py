"""Data: tokenizers, preprocessing, indexed datasets, GPTDataset, blends, mock data, sampler.

The trainer uses `build_tokenizer`, `check_vocab` and `DataProvider` (docs/ARCHITECTURE.md "Batch").
"""

from mptrain.data.errors import DataError
from mptrain.data.provider import DataProvider
from mptrain.data.tokenizers import Tokenizer, build_tokenizer, check_vocab

__all__ = ["DataError", "DataProvider", "Tokenizer", "build_tokenizer", "check_vocab"]
