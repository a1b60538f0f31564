"""The tokenizer files of a Hugging Face export, per training tokenizer (``data.tokenizer``), and an import's. An
`HFTokenizer`: its ``tokenizer.json`` copied, and the tokenizer_config.json / special_tokens_map.json beside it
(`TOKENIZER_SIDECARS`) with every field kept (``tokenizer_class``, ``add_bos_token``: the BOS rule travels,
`mptrain.data.tokenizers.bos_token_id`) but ``bos_token`` / ``eos_token``, which name config.json's ids. The
`ByteTokenizer`: an exact equivalent (GPT-2's byte-level pre-tokenizer, a BPE without merges mapping byte b's
character to id b, ``<|endoftext|>`` = 256, no BOS). The `GPT2BPETokenizer`: its vocab and merges as one
tokenizer.json. Any other: nothing (a note)."""

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

    # GPT-2's byte -> character table (encoder.py::bytes_to_unicode): printable bytes as is, the others 256, 257, ...
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_to_char = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    assert sorted(byte_to_char.values()) == sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOD_TOKEN])  # id 256: the next free id
    return tok.to_str()


def checkpoint_tokenizer(data_cfg: dict) -> tuple:
    """(the tokenizer of a saved ``data`` config, None when it cannot be made here; notes for the user)."""
    from mptrain.data.tokenizers import build_tokenizer
    from mptrain.errors import ConfigError

    try:
        return build_tokenizer(data_cfg), []
    except ConfigError as err:
        return None, [f"no tokenizer files written: the checkpoint's tokenizer cannot be made here ({err})"]


def write_tokenizer_files(data_cfg: dict, out: Path, *, model_max_length: int, special_ids: tuple = (None, None),
                          tokenizer=None) -> tuple[Optional[int], list, list]:
    """Write the tokenizer of ``data_cfg`` (``tokenizer``: it, already made) into ``out``. ``special_ids``: the (bos, eos)
    ids of config.json (ints or lists), None: the tokenizer's BOS (else EOD) and EOD. Returns (the EOD, None when the
    tokenizer cannot be made here; the files written; notes for the user)."""
    from mptrain.checkpoint.args import TOKENIZER_SIDECARS
    from mptrain.data.tokenizers import ByteTokenizer, GPT2BPETokenizer, HFTokenizer, tokenizer_config

    tokenizer, notes = (tokenizer, []) if tokenizer is not None else checkpoint_tokenizer(data_cfg)
    special, copied, base = {"bos_token": BYTE_EOD_TOKEN, "eos_token": BYTE_EOD_TOKEN}, [], {}
    if isinstance(tokenizer, HFTokenizer):
        source = Path(str(data_cfg["tokenizer"]["tokenizer_json"])).expanduser()
        shutil.copyfile(source, out / "tokenizer.json")
        copied = [n for n in TOKENIZER_SIDECARS if not n.endswith(".json") and (source.parent / n).is_file()]
        for name in copied:  # chat_template.jinja, as is
            shutil.copyfile(source.parent / name, out / name)
        base = {n: tokenizer_config(source, n) for n in ("tokenizer_config.json", "special_tokens_map.json")}
        for key, ids, default in zip(special, special_ids, (tokenizer.eod if tokenizer.bos is None else tokenizer.bos,
                                                            tokenizer.eod)):
            first = ids[0] if isinstance(ids, list) and ids else ids  # an id outside the vocabulary: the EOD's token
            special[key] = tokenizer.token(default if first is None else first) or tokenizer.token(tokenizer.eod)
    elif isinstance(tokenizer, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_level_tokenizer_json())
    elif isinstance(tokenizer, GPT2BPETokenizer):  # bos / eos: <|endoftext|>, GPT-2's
        (out / "tokenizer.json").write_text(tokenizer.tokenizer_json())
    else:
        return getattr(tokenizer, "eod", None), [], notes or [
            f"no tokenizer files written: {type(tokenizer).__name__} has no transformers equivalent (HFTokenizer, "
            "GPT2BPETokenizer and ByteTokenizer have); eos/bos ids are set"]
    # the tokenizer's own fields first (chat template, model_max_length, added tokens), bos / eos ours
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False, **base.get("tokenizer_config.json", {}),
              **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({**base.get("special_tokens_map.json", {}), **special}, indent=1))
    return tokenizer.eod, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", *copied], notes


def import_tokenizer(hf_path: Path, root: Path, cfg: dict) -> Optional[dict]:
    """``data.tokenizer`` of an import: `HFTokenizer` on the folder's tokenizer.json copied to ``root`` with its sidecars,
    EOD = the EOS (tokenizer_config.json's, else config.json's); None without a tokenizer.json."""
    from tokenizers import Tokenizer

    from mptrain.checkpoint.args import TOKENIZER_SIDECARS
    from mptrain.data.tokenizers import token_content, tokenizer_config

    if not (hf_path / "tokenizer.json").is_file():
        return None
    for name in ("tokenizer.json", *TOKENIZER_SIDECARS):
        if (hf_path / name).is_file():
            shutil.copyfile(hf_path / name, root / name)
    eos, eos_id = token_content(tokenizer_config(hf_path / "tokenizer.json").get("eos_token")), cfg.get("eos_token_id")
    if eos is None and eos_id is not None:
        eos = Tokenizer.from_file(str(root / "tokenizer.json")).id_to_token(eos_id[0] if isinstance(eos_id, list) else eos_id)
    return {"_target_": "mptrain.data.tokenizers.HFTokenizer", "tokenizer_json": str((root / "tokenizer.json").resolve()),
            "eod_token": eos or "<|endoftext|>"}
