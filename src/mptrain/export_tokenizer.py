"""The tokenizer files of a Hugging Face export (`python -m mptrain.export --format hf-gpt2`).

What `transformers.AutoTokenizer.from_pretrained(dir)` needs, per training tokenizer
(``data.tokenizer`` of the checkpoint's saved config):

| tokenizer | written | exact? |
|---|---|---|
| `HFTokenizer` | its ``tokenizer.json`` (copied), ``tokenizer_config.json``, ``special_tokens_map.json`` | the same file |
| `ByteTokenizer` | a ``tokenizer.json`` built here: GPT-2's byte-level pre-tokenizer (each byte → one printable character) and a BPE with no merges whose vocabulary maps the character of byte b to id b, plus ``<|endoftext|>`` = 256 | yes: encode gives the UTF-8 bytes, decode inverts them (invalid UTF-8 replaced, as ours) |
| `TiktokenTokenizer`, `NullTokenizer`, a user's | nothing (a note in the return value; the CLI prints it) | - |

EOD is the export's ``eos_token`` and ``bos_token`` (GPT-2's convention: one ``<|endoftext|>``
between documents), and the pad token of ``generation_config.json``, unless the model has bos / eos ids
of its own (an import's, `mptrain.export.special_ids`): then the HFTokenizer files name those tokens.

An HFTokenizer's ``tokenizer_config.json`` / ``special_tokens_map.json`` beside its ``tokenizer.json``
(an import keeps the Hugging Face folder's there, and every save keeps them beside ``latest``:
`mptrain.checkpoint.args.TOKENIZER_SIDECARS`) are the base of the written ones: every field is kept
(``chat_template``, ``model_max_length``, ``added_tokens_decoder``, ``tokenizer_class``, pad / unk
tokens, ...) but ``bos_token`` and ``eos_token``, which the export owns; ``chat_template.jinja`` is
copied as is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

BYTE_EOD_TOKEN = "<|endoftext|>"


def byte_level_tokenizer_json() -> str:
    """A `tokenizers` JSON equal to `ByteTokenizer` (ids 0..255 = bytes, 256 = EOD)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 characters GPT-2's byte-level mapping uses
    byte_to_char = _bytes_to_unicode()
    assert sorted(byte_to_char.values()) == sorted(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOD_TOKEN])  # id 256: the next free id
    return tok.to_str()


def _bytes_to_unicode() -> dict:
    """GPT-2's byte → character table (Radford et al. 2019, ``encoder.py::bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer_files(data_cfg: dict, out: Path, *, model_max_length: int,
                          special_ids: tuple = (None, None)) -> tuple[Optional[int], list, list]:
    """Write the tokenizer of ``data_cfg`` into ``out``.

    ``special_ids``: (bos, eos) ids the export writes into config.json when the model has its own (an
    import's; an int or a list of ints), else None: the tokenizer files then name the same tokens, so
    ``AutoTokenizer``'s ids agree with the model config's.

    Returns:
        (EOD id or None when the tokenizer cannot be built, the files written, notes for the user).
    """
    from mptrain.checkpoint.args import TOKENIZER_SIDECARS
    from mptrain.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer
    from mptrain.errors import ConfigError

    try:
        tokenizer = build_tokenizer(data_cfg)
    except ConfigError as err:
        return None, [], [f"no tokenizer files written: the checkpoint's tokenizer cannot be built here ({err})"]
    spec = data_cfg.get("tokenizer") or {}
    original: dict = {}  # the files beside the tokenizer.json: {name: JSON content}
    notes: list = []
    copied: list = []
    if isinstance(tokenizer, HFTokenizer):
        source = Path(str(spec["tokenizer_json"])).expanduser()
        shutil.copyfile(source, out / "tokenizer.json")
        eod_token = str(spec.get("eod_token", "<|endoftext|>"))
        for name in TOKENIZER_SIDECARS:
            path = source.parent / name
            if not path.is_file():
                continue
            if not name.endswith(".json"):
                shutil.copyfile(path, out / name)
                copied.append(name)
                continue
            try:
                original[name] = dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as err:
                notes.append(f"{path} is unreadable ({type(err).__name__}); written without its fields")
    elif isinstance(tokenizer, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_level_tokenizer_json())
        eod_token = BYTE_EOD_TOKEN
    else:
        return tokenizer.eod, [], [f"no tokenizer files written for {type(tokenizer).__name__} (only HFTokenizer and "
                                   "ByteTokenizer have a transformers equivalent); eos/bos ids are set"]
    special = {"bos_token": eod_token, "eos_token": eod_token}
    if isinstance(tokenizer, HFTokenizer):
        for key, ids in zip(("bos_token", "eos_token"), special_ids):
            first = ids[0] if isinstance(ids, list) and ids else ids
            name = tokenizer.token(first) if isinstance(first, int) else None
            special[key] = name if name is not None else eod_token
    # the tokenizer's own fields first (chat template, model_max_length, added tokens), bos / eos ours
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False,
              **original.get("tokenizer_config.json", {}), **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({**original.get("special_tokens_map.json", {}), **special},
                                                            indent=1))
    return tokenizer.eod, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", *copied], notes
