"""A user's tokenizer: characters of a vocabulary string (docs/COMPONENTS.md "Tokenizer").

It does not derive from any mptrain class: it only has what `mptrain.data.tokenizers.TokenizerProtocol`
reads (vocab_size, eod, fingerprint, encode, decode). Select it with

    python train.py data=shakespeare data.tokenizer._target_=mptrain_plugins.tokenizers.CharTokenizer
    python train.py ... data.tokenizer._target_=mptrain_plugins.tokenizers.CharTokenizer +data.tokenizer.vocab=abc
"""

from __future__ import annotations

import hashlib
import string
from typing import Sequence

DEFAULT_VOCAB = string.ascii_letters + string.digits + string.punctuation + " \n\t"


class CharTokenizer:
    """One id per character of `vocab` (in its order), then EOD, then UNK.

    Args:
        vocab: the characters (duplicates are an error).
    Ids: vocab[i] → i; EOD = len(vocab); UNK = len(vocab) + 1 (any other character);
    vocab_size = len(vocab) + 2. `decode` drops EOD and writes UNK as U+FFFD.
    Raises:
        ValueError: an empty vocabulary or a repeated character.
    """

    def __init__(self, vocab: str = DEFAULT_VOCAB) -> None:
        vocab = str(vocab)
        if not vocab or len(set(vocab)) != len(vocab):
            raise ValueError(f"vocab must be non-empty characters without repeats, got {vocab!r}")
        self.vocab = vocab
        self._ids = {c: i for i, c in enumerate(vocab)}
        self.eod = len(vocab)
        self.unk = len(vocab) + 1
        self.vocab_size = len(vocab) + 2
        self.fingerprint = "char:" + hashlib.sha1(vocab.encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self.unk) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] if i < self.eod else "\ufffd" for i in map(int, ids) if i != self.eod)
