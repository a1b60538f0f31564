"""The tokenizer files of a Hugging Face export, per training tokenizer (``data.tokenizer``), and an import's. An
`HFTokenizer`: its ``tokenizer.json`` copied, and the tokenizer_config.json / special_tokens_map.json beside it
(`TOKENIZER_SIDECARS`) with every field kept (``tokenizer_class``, ``add_bos_token``: the BOS rule travels,
`mptrain.data.tokenizers.bos_token_id`) but ``bos_token`` / ``eos_token``, which name config.json's ids. A tokenizer
with a ``tokenizer_json()`` (`ByteTokenizer`, `GPT2BPETokenizer`; bos / eos ``<|endoftext|>``): that JSON; any other:
nothing (a note)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer

from mptrain.checkpoint.args import TOKENIZER_SIDECARS
from mptrain.data.tokenizers import HFTokenizer, build_tokenizer, token_content, tokenizer_config
from mptrain.errors import ConfigError


def checkpoint_tokenizer(data_cfg: dict) -> tuple:
    """(the tokenizer of a saved ``data`` config, None when it cannot be made here; notes for the user)."""
    try:
        return build_tokenizer(data_cfg), []
    except ConfigError as err:
        return None, [f"no tokenizer files written: the checkpoint's tokenizer cannot be made here ({err})"]


def write_tokenizer_files(data_cfg: dict, out: Path, *, model_max_length: int, special_ids: tuple = (None, None),
                          tokenizer=None) -> tuple[Optional[int], list, list]:
    """Write the tokenizer of ``data_cfg`` (``tokenizer``: it, already made) into ``out``. ``special_ids``: the (bos, eos)
    ids of config.json (ints or lists), None: the tokenizer's BOS (else EOD) and EOD. Returns (the EOD, None when the
    tokenizer cannot be made here; the files written; notes for the user)."""
    tokenizer, notes = (tokenizer, []) if tokenizer is not None else checkpoint_tokenizer(data_cfg)
    special, copied, base = dict.fromkeys(("bos_token", "eos_token"), "<|endoftext|>"), [], {}
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
    elif callable(getattr(tokenizer, "tokenizer_json", None)):
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
