"""Train a byte-level BPE tokenizer (Hugging Face `tokenizers`) on a corpus.

    python -m mptrain.data.train_tokenizer --input corpus.jsonl[.gz] [more ...] --json-keys text \\
        --vocab-size 2048 --output tokenizer.json [--overwrite]

The result loads with `data.tokenizer={_target_: mptrain.data.tokenizers.HFTokenizer,
tokenizer_json: tokenizer.json}` (or `--tokenizer hf:tokenizer.json` in preprocessing); its EOD is
the special token `<|endoftext|>` (GPT-2's). Inputs are read like `preprocess` reads them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Sequence

from mptrain.data.errors import DataError
from mptrain.data.preprocess import iter_raw_documents
from mptrain.errors import ConfigError

EOD_TOKEN = "<|endoftext|>"


def _texts(inputs: Sequence[str], json_keys: Sequence[str]) -> Iterator[str]:
    for path, lineno, raw, is_json in iter_raw_documents(inputs):
        if not is_json:
            yield raw.decode("utf-8", errors="replace")
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}); fix: one JSON object per line") from None
        for key in json_keys:
            if not isinstance(obj, dict) or key not in obj:
                raise DataError(f"{path}:{lineno}: no key {key!r}; fix --json-keys or the line")
            yield str(obj[key])


def train_bpe(
    inputs: Sequence[str], *, output: str, vocab_size: int, json_keys: Sequence[str] = ("text",), overwrite: bool = False
) -> int:
    """Train byte-level BPE and save it as a `tokenizer.json`; return the vocabulary size.

    Args:
        vocab_size: target size including the 256 byte symbols and `<|endoftext|>` (>= 258).
    Raises:
        ConfigError: vocab_size too small, or the output exists without `overwrite`.
        DataError: bad input (see `preprocess`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ConfigError(f"--vocab-size {vocab_size}: byte-level BPE needs >= 258 (256 bytes + EOD + merges)")
    out = Path(output)
    if out.exists() and not overwrite:
        raise DataError(f"{out} exists; pass --overwrite to replace it or choose another --output")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(_texts(inputs, json_keys), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tok.save(str(tmp))
    tmp.replace(out)
    return tok.get_vocab_size(with_added_tokens=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mptrain.data.train_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSONL(.gz) or text files (as preprocess reads them)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys to read (default: text)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default: 4096)")
    parser.add_argument("--output", required=True, help="tokenizer.json path")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    args = parser.parse_args(argv)
    try:
        n = train_bpe(args.input, output=args.output, vocab_size=args.vocab_size, json_keys=args.json_keys, overwrite=args.overwrite)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"train_tokenizer: vocabulary of {n} -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
