"""Tokenizers as registered components (`data.tokenizer._target_`), after Megatron's
`megatron/training/tokenizer/tokenizer.py` (`_NullTokenizer`, `_HuggingFaceTokenizer`, `_TikTokenizer`).

Every tokenizer has `vocab_size` (ids are in [0, vocab_size)), `eod` (the end-of-document id that
preprocessing appends to each document), `encode(str) -> list[int]`, `decode(ids) -> str`,
`encode_array(str) -> np.ndarray` (a fast path for preprocessing) and `fingerprint` (a short
string that changes when the id mapping changes; it keys the preprocessed caches).

| `_target_` (or its last part) | files | vocab_size | eod |
|---|---|---|---|
| `mptrain.data.tokenizers.ByteTokenizer` | none | 257 (UTF-8 bytes + EOD) | 256 |
| `mptrain.data.tokenizers.HFTokenizer` | `tokenizer_json` | the file's, added tokens included | id of `eod_token` |
| `mptrain.data.tokenizers.TiktokenTokenizer` | tiktoken's local cache | `n_vocab` | `<|endoftext|>` |
| `mptrain.data.tokenizers.NullTokenizer` | none | `vocab_size` | `vocab_size - 1` |

`build_tokenizer(data_cfg)` looks `_target_` up in `TOKENIZERS` (an exhaustive registry: an unknown
name raises `ConfigError` listing the valid ones) and passes the other keys as arguments.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from mptrain.errors import ConfigError


class Tokenizer:
    """Base class: the interface the data pipeline and the trainer use."""

    vocab_size: int
    """Number of ids; every id is in [0, vocab_size)."""
    eod: int
    """End-of-document id appended after each document."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as an int64 array (subclasses override with a faster path)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    @property
    def fingerprint(self) -> str:
        """A short string identifying the id mapping (keys the preprocessed caches)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, EOD = 256 (vocab 257). Needs no files; the default for
    `data=shakespeare`. `decode` drops EOD ids and replaces invalid UTF-8."""

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def fingerprint(self) -> str:
        return "byte"


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer read from a `tokenizer.json` (train one with
    `python -m mptrain.data.train_tokenizer`).

    Args:
        tokenizer_json: path of the tokenizer file (relative paths are relative to the cwd).
        eod_token: the token used as end-of-document; it must be in the vocabulary.
    Raises:
        ConfigError: the file is missing or unreadable, or `eod_token` is not in its vocabulary.
    """

    def __init__(self, tokenizer_json: str, eod_token: str = "<|endoftext|>") -> None:
        from tokenizers import Tokenizer as _HF

        path = Path(str(tokenizer_json)).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"data.tokenizer.tokenizer_json={tokenizer_json}: no such file; train one with "
                f"`python -m mptrain.data.train_tokenizer --input CORPUS --output {tokenizer_json}` or fix the path"
            )
        raw = path.read_bytes()
        try:
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
            raise ConfigError(f"data.tokenizer.tokenizer_json={path}: not a tokenizers JSON file ({exc})") from exc
        eod = self._tok.token_to_id(eod_token)
        if eod is None:
            raise ConfigError(
                f"data.tokenizer.eod_token={eod_token!r} is not in the vocabulary of {path}; pass the tokenizer's "
                f"end-of-document token as data.tokenizer.eod_token"
            )
        self.eod = int(eod)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self._fingerprint = "hf:" + hashlib.sha1(raw).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


class TiktokenTokenizer(Tokenizer):
    """An OpenAI `tiktoken` encoding, usable only when the `tiktoken` package and the encoding's
    files are available locally (this project never downloads them).

    Args:
        encoding: tiktoken encoding name (gpt2, r50k_base, cl100k_base, o200k_base, ...).
    Raises:
        ConfigError: `tiktoken` is not installed, or the encoding cannot be loaded offline.
    """

    def __init__(self, encoding: str = "gpt2") -> None:
        try:
            import tiktoken
        except ImportError as exc:
            raise ConfigError(
                "data.tokenizer: TiktokenTokenizer needs the `tiktoken` package, which is not installed; "
                "install it (and its encoding files) or use mptrain.data.tokenizers.ByteTokenizer / HFTokenizer"
            ) from exc
        try:
            self._enc = tiktoken.get_encoding(encoding)
        except Exception as exc:  # noqa: BLE001 - network / file errors come in many types
            raise ConfigError(
                f"data.tokenizer.encoding={encoding!r}: tiktoken could not load it locally ({type(exc).__name__}); "
                f"put its files in tiktoken's cache (TIKTOKEN_CACHE_DIR) or use HFTokenizer with a tokenizer.json"
            ) from exc
        self.encoding = encoding
        self.eod = int(self._enc.eot_token)
        self.vocab_size = int(self._enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        return f"tiktoken:{self.encoding}"


class NullTokenizer(Tokenizer):
    """No text: ids are written as space-separated integers (Megatron's `_NullTokenizer`); for
    mock data. EOD is the last id, `vocab_size - 1`.

    Raises:
        ConfigError: vocab_size < 2.
    """

    def __init__(self, vocab_size: int) -> None:
        if int(vocab_size) < 2:
            raise ConfigError(f"data.tokenizer.vocab_size={vocab_size} must be >= 2 (ids plus an EOD id)")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def fingerprint(self) -> str:
        return f"null:{self.vocab_size}"


TOKENIZERS: dict[str, type[Tokenizer]] = {
    "ByteTokenizer": ByteTokenizer,
    "HFTokenizer": HFTokenizer,
    "TiktokenTokenizer": TiktokenTokenizer,
    "NullTokenizer": NullTokenizer,
}
"""The registry `data.tokenizer._target_` is looked up in (full dotted path or class name)."""

_DEFAULT_BY_DATA = {"mock": "NullTokenizer", "shakespeare": "ByteTokenizer"}


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def tokenizer_from_spec(spec: Mapping[str, Any] | None, *, data_name: str = "", data_vocab_size: int = 1000) -> Tokenizer:
    """Build a tokenizer from a `{_target_: ..., **kwargs}` mapping (None: the default for `data_name`).

    Raises:
        ConfigError: unknown `_target_` (lists the valid names), bad arguments, or no default.
    """
    if spec is None:
        name = _DEFAULT_BY_DATA.get(data_name)
        if name is None:
            raise ConfigError(
                f"data.tokenizer is null for data={data_name}; set data.tokenizer._target_ to one of "
                f"{sorted(TOKENIZERS)} (e.g. mptrain.data.tokenizers.HFTokenizer with tokenizer_json=PATH)"
            )
        spec = {"_target_": name, **({"vocab_size": data_vocab_size} if name == "NullTokenizer" else {})}
    spec = dict(spec)
    target = str(spec.pop("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    if name not in TOKENIZERS or target not in (name, f"{__name__}.{name}"):
        valid = ", ".join(f"{__name__}.{n}" for n in sorted(TOKENIZERS))
        raise ConfigError(f"data.tokenizer._target_={target!r} is not a registered tokenizer; use one of: {valid}")
    kwargs = {k: v for k, v in spec.items() if not k.startswith("_")}
    try:
        return TOKENIZERS[name](**kwargs)
    except TypeError as exc:
        raise ConfigError(f"data.tokenizer: {name} does not accept {sorted(kwargs)} ({exc}); fix data.tokenizer.*") from exc


def build_tokenizer(data_cfg: Any) -> Tokenizer:
    """The trainer's entry point: the tokenizer selected by `data.tokenizer` (a `DataConfig`,
    DictConfig or dict). `data.tokenizer: null` takes the default of the data option
    (mock: NullTokenizer(data.vocab_size); shakespeare: ByteTokenizer).

    Raises:
        ConfigError: see `tokenizer_from_spec` and the tokenizer constructors.
    """
    spec = _cfg_get(data_cfg, "tokenizer")
    if spec is not None and not isinstance(spec, Mapping):
        try:  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            spec = OmegaConf.to_container(spec, resolve=True)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"data.tokenizer={spec!r} must be a mapping with _target_") from exc
    return tokenizer_from_spec(
        spec, data_name=str(_cfg_get(data_cfg, "name", "")), data_vocab_size=int(_cfg_get(data_cfg, "vocab_size", 1000))
    )


def parse_cli_tokenizer(text: str) -> Tokenizer:
    """The preprocessing command's `--tokenizer`: `byte`, `hf:PATH`, `tiktoken:NAME` or `null:N`.

    Raises:
        ConfigError: an unknown form.
    """
    kind, _, arg = text.partition(":")
    if kind == "byte" and not arg:
        return ByteTokenizer()
    if kind == "hf" and arg:
        return HFTokenizer(arg)
    if kind == "tiktoken" and arg:
        return TiktokenTokenizer(arg)
    if kind == "null" and arg:
        return NullTokenizer(int(arg))
    raise ConfigError(f"--tokenizer {text!r}: use byte, hf:PATH/tokenizer.json, tiktoken:ENCODING or null:VOCAB_SIZE")


def check_vocab(tokenizer: Tokenizer, model_vocab_size: Optional[int]) -> int:
    """Check the model's vocabulary holds every token id; return the (unpadded) vocab size to build.

    Args:
        tokenizer: the data's tokenizer.
        model_vocab_size: `model.vocab_size`; None takes the tokenizer's size.
    Returns:
        `model_vocab_size`, or `tokenizer.vocab_size` when it is None.
    Raises:
        ConfigError: `model.vocab_size` < `tokenizer.vocab_size` (names `vocab_size`, both values, the fix).
    """
    if model_vocab_size is None:
        return int(tokenizer.vocab_size)
    if int(model_vocab_size) < int(tokenizer.vocab_size):
        raise ConfigError(
            f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, {type(tokenizer).__name__}); set model.vocab_size=null to take the "
            f"tokenizer's size, or a value >= {tokenizer.vocab_size}"
        )
    return int(model_vocab_size)
