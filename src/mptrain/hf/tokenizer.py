"""The tokenizer files of a Hugging Face export (what ``AutoTokenizer.from_pretrained(dir)`` reads), per training
tokenizer (``data.tokenizer``), and the tokenizer an import records:

- `HFTokenizer`: its ``tokenizer.json`` copied (the same ids, its BOS included: `mptrain.data.tokenizers.bos_token_id`;
  a BOS that only tokenizer_config.json's ``add_bos_token`` asks for is written into the copy's post-processor, the
  one transformers 5 reads), with every field of the tokenizer_config.json / special_tokens_map.json beside it
  (chat template, model_max_length, added and pad tokens; the import copies the folder's, each save keeps them
  beside ``latest``: `mptrain.checkpoint.args.TOKENIZER_SIDECARS`) but ``bos_token`` / ``eos_token``, which name
  config.json's ids (`mptrain.hf.convert.special_ids`).
- `ByteTokenizer`: an exact equivalent made here (GPT-2's byte-level pre-tokenizer, a BPE without merges mapping
  byte b's character to id b, ``<|endoftext|>`` = 256; no BOS; invalid UTF-8 replaced on decode, as ours).
- any other: nothing (a note).
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

    # GPT-2's byte -> character table (Radford et al. 2019, encoder.py::bytes_to_unicode): printable bytes
    # map to themselves, the others to 256, 257, ... in byte order
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_to_char = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    assert sorted(byte_to_char.values()) == sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOD_TOKEN])  # id 256: the next free id
    return tok.to_str()


def _copy_tokenizer_json(tokenizer, source: Path, dest: Path) -> None:
    """``source`` to ``dest``, a BOS template added to its post-processor when ``tokenizer`` adds a BOS it lacks."""
    from tokenizers import Tokenizer, processors

    from mptrain.data.tokenizers import bos_token_id

    tok = Tokenizer.from_file(str(source))
    if tokenizer.bos is None or bos_token_id(tok, {}) is not None:
        shutil.copyfile(source, dest)
        return
    bos = tok.id_to_token(tokenizer.bos)
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, tokenizer.bos)])
    tok.post_processor = template if tok.post_processor is None else processors.Sequence([tok.post_processor, template])
    tok.save(str(dest))


def checkpoint_tokenizer(data_cfg: dict) -> tuple:
    """(the tokenizer of a checkpoint's saved ``data`` config, or None when it cannot be made here; notes)."""
    from mptrain.data.tokenizers import build_tokenizer
    from mptrain.errors import ConfigError

    try:
        return build_tokenizer(data_cfg), []
    except ConfigError as err:
        return None, [f"no tokenizer files written: the checkpoint's tokenizer cannot be made here ({err})"]


def write_tokenizer_files(data_cfg: dict, out: Path, *, model_max_length: int, special_ids: tuple = (None, None),
                          tokenizer=None) -> tuple[Optional[int], list, list]:
    """Write the tokenizer of ``data_cfg`` (``tokenizer``: it, already made) into ``out``; ``special_ids``: config.json's
    (bos, eos) ids (ints or lists), None for the tokenizer's BOS (else EOD) and EOD. Returns (the EOD, None when the
    tokenizer cannot be made here; the files written; notes for the user)."""
    from mptrain.checkpoint.args import TOKENIZER_SIDECARS
    from mptrain.data.tokenizers import ByteTokenizer, HFTokenizer, tokenizer_config

    if tokenizer is None:
        tokenizer, notes = checkpoint_tokenizer(data_cfg)
        if tokenizer is None:
            return None, [], notes
    special, copied, base = {"bos_token": BYTE_EOD_TOKEN, "eos_token": BYTE_EOD_TOKEN}, [], {}
    if isinstance(tokenizer, HFTokenizer):
        source = Path(str(data_cfg["tokenizer"]["tokenizer_json"])).expanduser()
        _copy_tokenizer_json(tokenizer, source, out / "tokenizer.json")
        copied = [n for n in TOKENIZER_SIDECARS if not n.endswith(".json") and (source.parent / n).is_file()]
        for name in copied:
            shutil.copyfile(source.parent / name, out / name)
        base = {n: tokenizer_config(source, n) for n in ("tokenizer_config.json", "special_tokens_map.json")}
        defaults = (tokenizer.eod if tokenizer.bos is None else tokenizer.bos, tokenizer.eod)
        for key, ids, default in zip(special, special_ids, defaults):
            first = ids[0] if isinstance(ids, list) and ids else ids
            special[key] = tokenizer.token(default if first is None else first) or tokenizer.token(tokenizer.eod)
    elif isinstance(tokenizer, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_level_tokenizer_json())
    else:
        return tokenizer.eod, [], [f"no tokenizer files written for {type(tokenizer).__name__} (only HFTokenizer and "
                                   "ByteTokenizer have a transformers equivalent); eos/bos ids are set"]
    # the tokenizer's own fields first (chat template, model_max_length, added tokens), bos / eos ours
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False,
              **base.get("tokenizer_config.json", {}), **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({**base.get("special_tokens_map.json", {}), **special},
                                                            indent=1))
    return tokenizer.eod, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", *copied], []


def import_tokenizer(hf_path: Path, root: Path, cfg: dict) -> Optional[dict]:
    """``data.tokenizer`` of an import: an `HFTokenizer` on the folder's tokenizer.json, copied to ``root`` with its
    sidecars, EOD = the EOS (tokenizer_config.json's, else config.json's ``eos_token_id``); None without one."""
    from tokenizers import Tokenizer

    from mptrain.checkpoint.args import TOKENIZER_SIDECARS
    from mptrain.data.tokenizers import token_content, tokenizer_config

    if not (hf_path / "tokenizer.json").is_file():
        return None
    for name in ("tokenizer.json", *TOKENIZER_SIDECARS):
        if (hf_path / name).is_file():
            shutil.copyfile(hf_path / name, root / name)
    eos = token_content(tokenizer_config(hf_path / "tokenizer.json").get("eos_token"))
    if eos is None:
        eos_id = cfg.get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        eos = "<|endoftext|>" if eos_id is None else Tokenizer.from_file(str(root / "tokenizer.json")).id_to_token(eos_id)
    return {"_target_": "mptrain.data.tokenizers.HFTokenizer", "tokenizer_json": str((root / "tokenizer.json").resolve()),
            "eod_token": eos}
