"""Tokenizers: one interface (`TokenizerProtocol`), built from `data.tokenizer._target_` by
`build_tokenizer` with `mptrain.components.build`; after Megatron's
`megatron/training/tokenizer/tokenizer.py` (`_NullTokenizer`, `_HuggingFaceTokenizer`, `_GPT2BPETokenizer`,
`_TikTokenizer`).

Any importable class implementing the interface plugs in (docs/COMPONENTS.md "Tokenizer"), e.g.
`data.tokenizer._target_=mptrain_plugins.tokenizers.CharTokenizer`; the shipped ones:

| `_target_` | files | vocab_size | eod |
|---|---|---|---|
| `mptrain.data.tokenizers.ByteTokenizer` | none | 257 (UTF-8 bytes + EOD) | 256 |
| `mptrain.data.tokenizers.HFTokenizer` | `tokenizer_json` | the file's, added tokens included | id of `eod_token` |
| `mptrain.data.tokenizers.GPT2BPETokenizer` | `vocab_file`, `merge_file` (Megatron's GPT2BPETokenizer) | the vocab's | `<|endoftext|>` |
| `mptrain.data.tokenizers.TiktokenTokenizer` | tiktoken's local cache | `n_vocab` | `<|endoftext|>` |
| `mptrain.data.tokenizers.NullTokenizer` | none | `vocab_size` | `vocab_size - 1` |

`HFTokenizer` keeps its family's BOS rule (`bos_token_id`): a Llama / Mistral tokenizer starts every text
with its BOS token, as `transformers`' ``tok(text)`` does, so preprocessing, generation and an export agree.

Preprocessing records the tokenizer beside the index (`<prefix>.tokenizer.json`:
`write_tokenizer_record`), and the indexed providers refuse data made with another one
(`check_tokenizer_record`). Data preprocessed by Megatron carries no record: it is read with
`data.tokenizer` checked by id range only (`unrecorded_note`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from mptrain.components import ComponentKind, build, node_items, resolve
from mptrain.errors import ConfigError


@runtime_checkable
class TokenizerProtocol(Protocol):
    """What the trainer and the data pipeline read from a tokenizer (nothing else).

    Attributes (on the instance):
        vocab_size: int, the number of ids; every id `encode` returns is in [0, vocab_size). The
            model's vocabulary is `model.vocab_size`, or this when null (padded per layout).
        eod: int in [0, vocab_size), the end-of-document id preprocessing appends after each
            document (and that `data.eod_mask_loss` / `reset_*` look for).
        fingerprint: str, short, changes whenever the text → id mapping changes; it names the
            preprocessed caches and is recorded beside each preprocessed index.
    Methods:
        encode(text: str) -> list[int]: ids of `text`, no EOD added (a BOS first when the tokenizer's
            family adds one: `HFTokenizer`).
        decode(ids: Sequence[int]) -> str: text of `ids` (EOD dropped or rendered, the class decides).
        encode_array(text) -> np.ndarray (optional): a fast path for preprocessing; without it
            `encode` is used.
        tokenizer_json() -> str (optional): the tokenizer as one Hugging Face `tokenizers` JSON whose EOD
            is ``<|endoftext|>``: the tokenizer.json of a ``--format hf`` export (`mptrain.hf.tokenizer`).
    """

    vocab_size: int
    eod: int

    @property
    def fingerprint(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


TOKENIZER = ComponentKind("tokenizer", methods=("encode", "decode"), interface=TokenizerProtocol)
"""`data.tokenizer`: built with no runtime keywords (its arguments are its node's keys)."""


class Tokenizer:
    """Base class of the shipped tokenizers (a user's tokenizer need not derive from it: `TokenizerProtocol`)."""

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

    EOD_TOKEN = "<|endoftext|>"  # the EOD's token in `tokenizer_json`

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def tokenizer_json(self) -> str:
        """This tokenizer as one `tokenizers` JSON (a Hugging Face export's), exactly: GPT-2's byte-level
        pre-tokenizer and decoder, a BPE without merges mapping byte b's character to id b, `EOD_TOKEN` = 256,
        no BOS."""
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders, models, pre_tokenizers
        from tokenizers.pre_tokenizers import ByteLevel

        # GPT-2's byte -> character table (encoder.py::bytes_to_unicode): printable bytes as is, the others 256, ...
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        byte_to_char = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
        assert sorted(byte_to_char.values()) == sorted(ByteLevel.alphabet())
        tok = _HF(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([self.EOD_TOKEN])  # id 256: the next free id
        return tok.to_str()

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
            named = _eod_candidates(self._tok, path)
            raise ConfigError(
                f"data.tokenizer.eod_token={eod_token!r} is not in the vocabulary of {path}; pass the tokenizer's "
                f"end-of-document token as ++data.tokenizer.eod_token=TOKEN (to mptrain.data.preprocess: --tokenizer "
                f"hf:{tokenizer_json}:TOKEN){named}"
            )
        self.eod = int(eod)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos: Optional[int] = bos_token_id(self._tok, tokenizer_config(path))
        """The id every encoded text starts with (`bos_token_id`); None when the family adds none (GPT-2, Qwen2)."""
        # the BOS rule may come from tokenizer_config.json: data made under another rule is another mapping
        self._fingerprint = "hf:" + hashlib.sha1(raw).hexdigest()[:16] + ("" if self.bos is None else f"+bos{self.bos}")

    def encode(self, text: str) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        return ids if self.bos is None else [self.bos, *ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, token_id: int) -> Optional[str]:
        """The token string of ``token_id`` (None outside the vocabulary), e.g. for an export's special tokens."""
        return self._tok.id_to_token(int(token_id))

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from its two files: Megatron's ``--tokenizer-type GPT2BPETokenizer --vocab-file
    gpt2-vocab.json --merge-file gpt2-merges.txt`` (``_GPT2BPETokenizer``), built on Hugging Face `tokenizers`.

    The model is ``models.BPE.from_file(vocab_file, merge_file)`` behind GPT-2's byte-level pre-tokenizer (its
    regex, no prefix space) and byte-level decoder, so ids equal `transformers`' ``GPT2Tokenizer`` /
    ``GPT2TokenizerFast(vocab_file, merges_file)`` on any text. No token is special: ``<|endoftext|>`` written in
    a text is encoded as text, as Megatron's tokenizer (which registers no special tokens) and tiktoken's
    ``encode_ordinary`` do (transformers with ``split_special_tokens=True``). No BOS is added.

    Attributes:
        vocab_size: the vocabulary file's ids (``len(vocab)``: Megatron's ``vocab_size``), 50257 for GPT-2.
        eod: the id of ``<|endoftext|>`` (Megatron's ``eod``), 50256 for GPT-2.
    Args:
        vocab_file: JSON object token → id (relative paths are relative to the cwd).
        merge_file: one merge ``a b`` per line, by rank, after a ``#version`` header.
    Raises:
        ConfigError: a file is missing or unreadable, ids are not 0..n-1, or ``<|endoftext|>`` is not in the
            vocabulary.
    """

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders, models, pre_tokenizers

        paths = {"vocab_file": Path(str(vocab_file)).expanduser(), "merge_file": Path(str(merge_file)).expanduser()}
        for key, path in paths.items():
            if not path.is_file():
                raise ConfigError(f"data.tokenizer.{key}={path}: no such file; give GPT-2's file (Megatron's "
                                  f"--{key.replace('_', '-')}: gpt2-vocab.json, gpt2-merges.txt)")
        try:
            vocab = json.loads(paths["vocab_file"].read_text(encoding="utf-8"))
            merges = paths["merge_file"].read_text(encoding="utf-8")
            self._tok = _HF(models.BPE.from_file(str(paths["vocab_file"]), str(paths["merge_file"])))
        except Exception as exc:  # noqa: BLE001 - json and tokenizers raise plain Exception subclasses
            raise ConfigError(f"data.tokenizer: {paths['vocab_file']} and {paths['merge_file']} are not a GPT-2 vocab.json "
                              f"and merges.txt ({type(exc).__name__}: {exc})") from None
        ids = sorted(vocab.values()) if all(isinstance(i, int) for i in vocab.values()) else None
        if ids != list(range(len(vocab))):  # Megatron's vocab_size is len(vocab): every id below it names a token
            raise ConfigError(f"data.tokenizer.vocab_file={vocab_file}: its ids are not 0..{len(vocab) - 1}, each once; "
                              "give GPT-2's vocab.json")
        if self.EOD_TOKEN not in vocab:
            raise ConfigError(f"data.tokenizer.vocab_file={vocab_file} has no {self.EOD_TOKEN!r} token (the end-of-document "
                              "id of Megatron's GPT2BPETokenizer); give GPT-2's vocab.json")
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex split, bytes as chars
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_file, self.merge_file = str(vocab_file), str(merge_file)
        self.vocab_size = len(vocab)
        self.eod = int(vocab[self.EOD_TOKEN])
        # the mapping's content, not the files' bytes: a vocab.json written with other spacing or key order is the same
        merge_lines = [line for line in merges.splitlines() if line.strip() and not line.startswith("#version")]
        content = json.dumps(sorted(vocab.items()), ensure_ascii=False) + "\n" + "\n".join(merge_lines)
        self._fingerprint = "gpt2bpe:" + hashlib.sha1(content.encode("utf-8")).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; EOD reads ``<|endoftext|>``, invalid UTF-8 U+FFFD (Megatron's ``errors='replace'``)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def tokenizer_json(self) -> str:
        """This tokenizer as one `tokenizers` JSON (the BPE, pre-tokenizer and decoder): a Hugging Face export's."""
        return self._tok.to_str()

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


def tokenizer_config(path: Path, name: str = "tokenizer_config.json") -> dict:
    """The JSON object ``name`` beside tokenizer file ``path`` ({} when there is none or it is unreadable)."""
    try:
        config = json.loads((Path(path).parent / name).read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def token_content(value: Any) -> Optional[str]:
    """A special token of tokenizer_config.json: a string, or (older files) an AddedToken's fields."""
    return value.get("content") if isinstance(value, dict) else value


def bos_token_id(tok: Any, config: dict) -> Optional[int]:
    """The BOS id a Hugging Face tokenizer starts each text with (Llama, Mistral); None when it adds none (GPT-2, Qwen2).

    The rule transformers applies: the special token the tokenizer.json post-processor puts before the text (a
    TemplateProcessing ``<s> $A``, alone or in a Sequence: Llama 2 / 3, Mistral); else ``bos_token`` when
    ``config`` (the tokenizer_config.json beside it) has ``add_bos_token: true`` and a ``tokenizer_class`` that
    reads it (Llama's, Gemma's; transformers' generic fast tokenizer reads the post-processor alone). A trailing
    special token (an EOS) is never added: preprocessing appends the EOD itself.

    Args:
        tok: a `tokenizers.Tokenizer`.
    """
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    # a word of its own vocabulary: it encodes to a token or more (a made-up one may fail: WordLevel without unk)
    word = next((w for w in tok.get_vocab() if w.isalnum() and w not in special), "a")
    probe = tok.encode(word)  # the post-processor's own tokens are flagged in special_tokens_mask
    if probe.special_tokens_mask[:2] == [1, 0]:
        return int(probe.ids[0])
    generic = config.get("tokenizer_class") in (None, "PreTrainedTokenizerFast", "TokenizersBackend")
    name = None if generic or config.get("add_bos_token") is not True else token_content(config.get("bos_token"))
    return None if name is None else tok.token_to_id(name)


def _eod_candidates(tok: Any, path: Path) -> str:
    """``"; ..."``: the end-of-document tokens a tokenizer file offers (the ``eos_token`` of the
    tokenizer_config.json beside it, its special added tokens), for the error when ``eod_token`` is missing."""
    notes = []
    eos = token_content(tokenizer_config(path).get("eos_token"))
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        notes.append(f"tokenizer_config.json beside it names eos_token {eos!r}")
    special = [t.content for _, t in sorted(tok.get_added_tokens_decoder().items()) if t.special]
    if special:
        notes.append(f"its special tokens: {', '.join(special[:8])}")
    return "".join(f"; {n}" for n in notes)


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


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def tokenizer_node(data_cfg: Any) -> Any:
    """`data.tokenizer` of a data config (DataConfig, DictConfig or dict).

    Raises:
        ConfigError: it is null or not a mapping with ``_target_``.
    """
    node = _cfg_get(data_cfg, "tokenizer")
    if node is None:
        raise ConfigError("data.tokenizer is null; set data.tokenizer._target_ to a tokenizer class, e.g. "
                          "mptrain.data.tokenizers.ByteTokenizer or mptrain.data.tokenizers.HFTokenizer "
                          "+data.tokenizer.tokenizer_json=PATH")
    if isinstance(node, str) or not (isinstance(node, Mapping) or hasattr(node, "keys")):
        raise ConfigError(f"data.tokenizer={node!r} must be a mapping with _target_ (data.tokenizer._target_=module.Class)")
    return node


def resolve_tokenizer(data_cfg: Any) -> None:
    """The start-up check of `data.tokenizer` (import, methods, keywords; nothing is built).

    Raises:
        ConfigError: one line naming `data.tokenizer._target_` (or the bad keyword) and the fix.
    """
    resolve("data.tokenizer", tokenizer_node(data_cfg), TOKENIZER)


def build_tokenizer(data_cfg: Any) -> TokenizerProtocol:
    """The one place a tokenizer is built: `data.tokenizer` with `mptrain.components.build`, then its
    attributes checked (`vocab_size` an int >= 1, `eod` an id below it, `fingerprint` a string).

    Args:
        data_cfg: the `data` config (DataConfig, DictConfig or a dict holding ``tokenizer``).
    Raises:
        ConfigError: null / not importable / missing method / bad keyword / missing or bad
            attribute, naming `data.tokenizer._target_`; and the tokenizer's own errors.
    """
    node = tokenizer_node(data_cfg)
    tok = build("data.tokenizer", node, TOKENIZER)
    target = node_items(node).get("_target_")
    problems = []
    for attr, kind in (("vocab_size", int), ("eod", int), ("fingerprint", str)):
        value = getattr(tok, attr, None)
        if not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"{attr} ({kind.__name__}; got {type(value).__name__})")
    if problems:
        raise ConfigError(f"data.tokenizer._target_={target} is not a valid tokenizer: its instance lacks "
                          f"{', '.join(problems)}; the tokenizer interface ({__name__}.TokenizerProtocol) needs "
                          "vocab_size, eod, fingerprint, encode, decode")
    if not (tok.vocab_size >= 1 and 0 <= tok.eod < tok.vocab_size):
        raise ConfigError(f"data.tokenizer._target_={target}: eod={tok.eod} must be an id in [0, vocab_size="
                          f"{tok.vocab_size}); fix the tokenizer")
    return tok


def encode_array(tokenizer: Any, text: str) -> np.ndarray:
    """`tokenizer.encode_array(text)` when the tokenizer has that fast path, else `encode` as int64."""
    fast = getattr(tokenizer, "encode_array", None)  # optional member of the interface
    return fast(text) if fast is not None else np.asarray(tokenizer.encode(text), dtype=np.int64)


# --- the record of the tokenizer a preprocessed dataset was made with ---------------------------------
RECORD_SUFFIX = ".tokenizer.json"
"""`<prefix>.tokenizer.json`, beside `<prefix>.bin/.idx` (Megatron's .idx format stays untouched)."""


def tokenizer_record(tokenizer: Any) -> dict:
    """What `mptrain.data.preprocess` writes beside the index: class, fingerprint, vocab_size, eod."""
    cls = type(tokenizer)
    return {"tokenizer": f"{cls.__module__}.{cls.__qualname__}", "fingerprint": str(tokenizer.fingerprint),
            "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod)}


def write_tokenizer_record(prefix: str, tokenizer: Any) -> Path:
    """Write `<prefix>.tokenizer.json` (through a temporary file and a rename)."""
    path = Path(f"{prefix}{RECORD_SUFFIX}")
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(tokenizer_record(tokenizer), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def recorded_eod(prefix: str) -> Optional[int]:
    """The EOD id `<prefix>.tokenizer.json` records; None when there is no readable record of it."""
    try:
        eod = json.loads(Path(f"{prefix}{RECORD_SUFFIX}").read_text()).get("eod")
        return None if eod is None else int(eod)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def check_tokenizer_record(prefix: str, tokenizer: Any) -> bool:
    """Compare the record of `prefix` with the configured tokenizer.

    Returns:
        True when they match; False when `prefix` has no record (Megatron's preprocessing, or mptrain's before
        it wrote one): the data is accepted, guarded by the token-id range check alone
        (`IndexedDataset.max_token_id`); the caller says so once (`unrecorded_note`).
    Raises:
        ConfigError: the record names another tokenizer (fingerprint differs), another EOD id (the same
            tokenizer file with another ``eod_token``: the fingerprint is the file's), or is unreadable.
    """
    path = Path(f"{prefix}{RECORD_SUFFIX}")
    if not path.is_file():
        return False
    try:
        record = json.loads(path.read_text())
        made_with, fingerprint = str(record["tokenizer"]), str(record["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"data.tokenizer: {path} is unreadable ({type(exc).__name__}: {exc}); re-run "
                          "`python -m mptrain.data.preprocess ... --overwrite`") from None
    if fingerprint != str(tokenizer.fingerprint):
        mine = tokenizer_record(tokenizer)
        raise ConfigError(
            f"data.tokenizer: {prefix} was preprocessed with {made_with} (fingerprint {fingerprint}) but "
            f"data.tokenizer is {mine['tokenizer']} (fingerprint {mine['fingerprint']}); set "
            f"data.tokenizer._target_={made_with} (and its arguments), or re-run preprocessing with this tokenizer")
    eod = record.get("eod")  # recorded since the record exists; a record without it is not checked
    if eod is not None and int(eod) != int(tokenizer.eod):
        name = getattr(tokenizer, "token", None)  # HFTokenizer: the token string, for the fix
        token = name(int(eod)) if callable(name) else None
        fix = (f"set data.tokenizer.eod_token={token!r} (id {int(eod)})" if token is not None
               else "set data.tokenizer to the one it was made with")
        raise ConfigError(
            f"data.tokenizer: {prefix} was preprocessed with EOD id {int(eod)} but data.tokenizer's EOD is "
            f"{int(tokenizer.eod)}; {fix}, or re-run `python -m mptrain.data.preprocess ... --overwrite` with this "
            "tokenizer's EOD")
    return True


def unrecorded_note(prefixes: Sequence[str]) -> str:
    """The one line said for datasets without a tokenizer record (`check_tokenizer_record` False), e.g. made by
    Megatron's ``tools/preprocess_data.py``: what is not checked, and the command that records the tokenizer."""
    shown = [str(p) for p in prefixes[:3]]
    what = ", ".join(shown) + (f" and {len(prefixes) - 3} more" if len(prefixes) > 3 else "")
    args = " ".join(shown) if len(prefixes) <= 3 else "PREFIX ..."
    return (f"data: {what} {'has' if len(prefixes) == 1 else 'have'} no {RECORD_SUFFIX} (Megatron's preprocessing "
            f"writes none): token ids are checked against data.tokenizer's vocab_size only, not its vocabulary; to "
            f"record the tokenizer: python -m mptrain.data.preprocess --record {args} --vocab-file V --merge-file M "
            f"(or --tokenizer ...)")


def parse_cli_tokenizer(text: str) -> Tokenizer:
    """The preprocessing command's `--tokenizer`: `byte`, `hf:PATH` (EOD ``<|endoftext|>``), `hf:PATH:EOD_TOKEN`,
    `tiktoken:NAME`, `null:N`, or
    `class:module.Class` (any tokenizer class built without arguments, e.g. a user's).

    Raises:
        ConfigError: an unknown form, or a class that is not a tokenizer.
    """
    kind, _, arg = text.partition(":")
    if kind == "class" and arg:
        return build_tokenizer({"tokenizer": {"_target_": arg}})
    if kind == "byte" and not arg:
        return ByteTokenizer()
    if kind == "hf" and arg:
        path, sep, eod = arg.rpartition(":")  # hf:PATH:EOD_TOKEN names the EOD (a Llama 3's <|end_of_text|>)
        return HFTokenizer(path, eod) if sep and not arg.endswith(".json") else HFTokenizer(arg)
    if kind == "tiktoken" and arg:
        return TiktokenTokenizer(arg)
    if kind == "null" and arg:
        return NullTokenizer(int(arg))
    raise ConfigError(f"--tokenizer {text!r}: use byte, hf:PATH/tokenizer.json, tiktoken:ENCODING, null:VOCAB_SIZE "
                      "or class:module.Class")


def check_vocab_size(model_vocab_size: Optional[int], tokenizer_vocab_size: int, *,
                     from_checkpoint: bool = False) -> int:
    """The model's unpadded vocabulary: `model.vocab_size`, or the tokenizer's size when it is None.

    Args:
        model_vocab_size: `model.vocab_size` (None takes the tokenizer's).
        tokenizer_vocab_size: the data tokenizer's ``vocab_size`` (ids below it).
        from_checkpoint: `model.vocab_size` came from the checkpoint (``checkpoint.use_checkpoint_args``),
            so the fix is a smaller tokenizer, not another model vocabulary.
    Raises:
        ConfigError: the tokenizer has more ids than the model's vocabulary (DESIGN.md §5 `vocab_size`).
    """
    if model_vocab_size is None:
        return int(tokenizer_vocab_size)
    if int(tokenizer_vocab_size) <= int(model_vocab_size):
        return int(model_vocab_size)
    if from_checkpoint:
        raise ConfigError(
            f"model.vocab_size={model_vocab_size} (the checkpoint's, checkpoint.use_checkpoint_args) is smaller than "
            f"the tokenizer's {tokenizer_vocab_size} ids; use the checkpoint's tokenizer or one of at most "
            f"{model_vocab_size} ids (data=mock: data.vocab_size<={model_vocab_size})"
        )
    raise ConfigError(
        f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size} ids; "
        f"set model.vocab_size=null (take the tokenizer's) or >= {tokenizer_vocab_size}"
    )
