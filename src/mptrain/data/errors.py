"""The data pipeline's error type: bad input files, not bad code."""

from __future__ import annotations

from mptrain.errors import ConfigError


class DataError(ConfigError):
    """A bad input (corpus line, missing/truncated .bin/.idx, empty split, tokenizer too large).

    A `ConfigError` subclass, so `train.py` prints its one line (file, line or document number,
    the fix) and exits 1 without a traceback.
    """
