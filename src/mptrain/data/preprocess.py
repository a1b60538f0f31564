"""Corpus → indexed dataset (after Megatron's `tools/preprocess_data.py`).

    python -m mptrain.data.preprocess --input corpus.jsonl[.gz] [more ...] --json-keys text \\
        --tokenizer byte|hf:PATH|tiktoken:NAME|null:N|class:module.Class --output-prefix out --workers 2 [--overwrite]
    python -m mptrain.data.preprocess --input corpus.jsonl --output-prefix out \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
    python -m mptrain.data.preprocess --record PREFIX [more ...] --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

Inputs: JSON Lines (`.jsonl`, `.json`, optionally `.gz`): one object per line, the text under
each `--json-keys` key, one document per line (blank lines are skipped); any other file
(`.txt`, optionally `.gz`) is one document. Each document becomes one sequence: its tokens
followed by the tokenizer's EOD. One key writes `<prefix>.bin/.idx`; several keys write
`<prefix>_<key>.bin/.idx` each (Megatron's naming). Existing outputs are refused unless
`--overwrite`; outputs are written to temporary files renamed at the end (`IndexedDatasetWriter`).
Beside each index goes `<prefix>.tokenizer.json` (the tokenizer's class, fingerprint, vocab_size
and eod; `mptrain.data.tokenizers.write_tokenizer_record`): reading the data with another
tokenizer is then one `ConfigError` naming `data.tokenizer`. The .idx stays Megatron's format.
Megatron's `--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M` select
`GPT2BPETokenizer` (the type may be left out), as `tools/preprocess_data.py` reads them.

`--record PREFIX ...` tokenizes nothing: it writes the record beside datasets preprocessed elsewhere
(Megatron's `tools/preprocess_data.py` writes none), after checking that every id is below the
tokenizer's vocab_size (`record_tokenizer`).

Errors (`DataError`, one line): a line that is not JSON or not an object, a missing key or a
non-string value (file:line and the keys found), an empty corpus, an existing output.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mptrain.data.errors import DataError
from mptrain.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from mptrain.data.tokenizers import (
    RECORD_SUFFIX,
    GPT2BPETokenizer,
    Tokenizer,
    encode_array,
    parse_cli_tokenizer,
    tokenizer_record,
    write_tokenizer_record,
)
from mptrain.errors import ConfigError

_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _is_json_lines(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name.endswith(_JSON_SUFFIXES)


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def iter_raw_documents(inputs: Sequence[str]) -> Iterator[tuple[str, int, bytes, bool]]:
    """Yield `(file, line number (1-based; 1 for a text file), raw bytes, is_json)` per document.

    Raises:
        DataError: an input that does not exist.
    """
    for name in inputs:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"{path}: no such input file; fix --input")
        with _open_binary(path) as f:
            if _is_json_lines(path):
                for lineno, raw in enumerate(f, 1):
                    if raw.strip():
                        yield str(path), lineno, raw, True
            else:
                yield str(path), 1, f.read(), False


def _encode_document(item: tuple[str, int, bytes, bool], *, tokenizer: Tokenizer, json_keys: tuple[str, ...]) -> list[np.ndarray]:
    """Parse and tokenize one document; return one token array (EOD appended) per key."""
    path, lineno, raw, is_json = item
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}:{lineno}: not UTF-8 ({exc.reason} at byte {exc.start}); fix the file's encoding") from None
    if is_json:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); fix: one JSON object per line") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: a JSON {type(obj).__name__}, not an object; fix: one JSON object per line")
        texts = []
        for key in json_keys:
            if key not in obj:
                raise DataError(f"{path}:{lineno}: no key {key!r} (keys: {sorted(obj)}); fix --json-keys or the line")
            if not isinstance(obj[key], str):
                raise DataError(f"{path}:{lineno}: key {key!r} holds a {type(obj[key]).__name__}, not a string")
            texts.append(obj[key])
    else:
        texts = [text]
    out = []
    for t in texts:
        ids = encode_array(tokenizer, t)
        out.append(np.concatenate([ids, np.asarray([tokenizer.eod], dtype=ids.dtype)]))
    return out


def output_prefixes(output_prefix: str, json_keys: Sequence[str]) -> list[str]:
    """`[output_prefix]` for one key, `[output_prefix_<key>, ...]` for several."""
    if len(json_keys) == 1:
        return [str(output_prefix)]
    return [f"{output_prefix}_{key}" for key in json_keys]


def preprocess(
    inputs: Sequence[str],
    *,
    output_prefix: str,
    tokenizer: Tokenizer,
    json_keys: Sequence[str] = ("text",),
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> list[str]:
    """Tokenize a corpus into indexed datasets; return the output prefixes (one per key).

    Args:
        inputs: JSONL (`.jsonl/.json[.gz]`) or text files, read in order.
        output_prefix: path without extension.
        tokenizer: its `eod` is appended to every document; its `vocab_size` picks the token dtype.
        json_keys: keys to read from each JSON object.
        workers: tokenizing processes (1: in this process).
        overwrite: replace existing outputs.
        progress: show a tqdm bar on stderr.
    Raises:
        DataError: see the module docstring.
    """
    json_keys = tuple(json_keys)
    if not json_keys:
        raise ConfigError("--json-keys: give at least one key")
    has_text = any(not _is_json_lines(Path(p)) for p in inputs)
    if has_text and len(json_keys) > 1:
        raise ConfigError(f"--json-keys {list(json_keys)}: several keys need JSONL inputs (a text file is one document)")
    prefixes = output_prefixes(output_prefix, json_keys)
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if Path(prefix + ext).exists() and not overwrite:
                raise DataError(f"{prefix}{ext} exists; pass --overwrite to replace it or choose another --output-prefix")
    from tqdm import tqdm

    dtype = token_dtype(tokenizer.vocab_size)
    encode = functools.partial(_encode_document, tokenizer=tokenizer, json_keys=json_keys)
    writers = [IndexedDatasetWriter(p, dtype) for p in prefixes]
    pool = mp.get_context("spawn").Pool(workers) if workers > 1 else None
    t0 = time.monotonic()
    try:
        docs = iter_raw_documents(inputs)
        results = pool.imap(encode, docs, chunksize=8) if pool else map(encode, docs)
        bar = tqdm(results, unit="doc", file=sys.stderr, disable=not progress, desc="preprocess")
        num_docs = 0
        for arrays in bar:
            for writer, arr in zip(writers, arrays):
                writer.add_document(arr)
            num_docs += 1
            bar.set_postfix(tokens=writers[0].num_tokens, refresh=False)
        if num_docs == 0:
            raise DataError(f"{', '.join(map(str, inputs))}: empty corpus (no documents); fix --input")
        if writers[0].num_tokens == num_docs:  # only EOD tokens: every text was empty
            raise DataError(f"{', '.join(map(str, inputs))}: empty corpus ({num_docs} documents, all empty text)")
        for writer in writers:
            writer.finalize()
        for prefix in prefixes:  # the tokenizer the ids come from (checked when the data is read)
            write_tokenizer_record(prefix, tokenizer)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    if progress:
        print(
            f"preprocess: {num_docs} documents, {writers[0].num_tokens} tokens ({dtype}) -> "
            f"{', '.join(prefixes)} in {time.monotonic() - t0:.1f} s",
            file=sys.stderr,
        )
    return prefixes


def record_tokenizer(prefixes: Sequence[str], tokenizer: Tokenizer, *, overwrite: bool = False) -> list[Path]:
    """Write `<prefix>.tokenizer.json` beside existing datasets (made by Megatron's `tools/preprocess_data.py`,
    which writes none), so that reading them with another tokenizer is refused as for mptrain's own; return the
    files written. Every prefix is checked before any file is written.

    Args:
        prefixes: datasets (`<prefix>.bin` / `.idx`).
        tokenizer: the tokenizer the data was made with (the caller's word: only the id range is checkable).
        overwrite: replace a record of another tokenizer.
    Raises:
        DataError: a missing or corrupt dataset, an id at or above the tokenizer's vocab_size, or a record of
            another tokenizer without `overwrite`.
    """
    mine = tokenizer_record(tokenizer)
    for prefix in prefixes:
        max_id = IndexedDataset(prefix).max_token_id()  # one pass over the .bin
        if max_id >= tokenizer.vocab_size:
            raise DataError(f"{prefix}.bin holds token id {max_id} but {mine['tokenizer']} has {tokenizer.vocab_size} "
                            "ids: the data was made with another tokenizer; give that one")
        path = Path(f"{prefix}{RECORD_SUFFIX}")
        try:
            recorded = json.loads(path.read_text()).get("fingerprint") if path.is_file() else None
        except (OSError, ValueError, AttributeError):
            recorded = "unreadable"
        if recorded not in (None, mine["fingerprint"]) and not overwrite:
            raise DataError(f"{path} records another tokenizer (fingerprint {recorded}, this one's is "
                            f"{mine['fingerprint']}); pass --overwrite to replace it")
    return [write_tokenizer_record(prefix, tokenizer) for prefix in prefixes]


def cli_tokenizer(tokenizer: str | None, tokenizer_type: str | None, vocab_file: str | None,
                  merge_file: str | None) -> Tokenizer:
    """The command line's tokenizer: ``--tokenizer`` (`parse_cli_tokenizer`; default byte), or Megatron's
    ``--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M`` (the type may be left out).

    Raises:
        ConfigError: both forms, another Megatron tokenizer type, or a GPT-2 file missing from the flags.
    """
    if not (tokenizer_type or vocab_file or merge_file):
        return parse_cli_tokenizer(tokenizer or "byte")
    if tokenizer is not None:
        raise ConfigError(f"--tokenizer {tokenizer} with --tokenizer-type / --vocab-file / --merge-file: give one "
                          "tokenizer")
    if tokenizer_type not in (None, "GPT2BPETokenizer"):
        raise ConfigError(f"--tokenizer-type {tokenizer_type}: only GPT2BPETokenizer (with --vocab-file and "
                          "--merge-file) is read here; a Hugging Face tokenizer is --tokenizer hf:PATH/tokenizer.json")
    if not (vocab_file and merge_file):
        raise ConfigError("GPT2BPETokenizer needs --vocab-file and --merge-file (gpt2-vocab.json, gpt2-merges.txt)")
    return GPT2BPETokenizer(vocab_file, merge_file)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mptrain.data.preprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+",
                        help="JSONL(.gz) files (one document per line, its --json-keys) or text files (each file one "
                             "document: split a text into files, or into JSONL lines, for several)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="JSONL keys to tokenize, each into its own dataset PREFIX_KEY when several (default: text)")
    parser.add_argument("--tokenizer", help="byte (default) | hf:PATH[:EOD_TOKEN] | tiktoken:NAME | null:N | class:module.Class")
    parser.add_argument("--tokenizer-type", help="Megatron's: GPT2BPETokenizer (with --vocab-file, --merge-file)")
    parser.add_argument("--vocab-file", help="GPT-2's vocab.json (Megatron's GPT2BPETokenizer)")
    parser.add_argument("--merge-file", help="GPT-2's merges.txt (Megatron's GPT2BPETokenizer)")
    parser.add_argument("--output-prefix", help="writes PREFIX.bin, PREFIX.idx (data.prefixes=[PREFIX])")
    parser.add_argument("--record", nargs="+", metavar="PREFIX",
                        help="tokenize nothing: write PREFIX.tokenizer.json beside existing PREFIX.bin/.idx (made by "
                             "Megatron's preprocess_data.py) for the given tokenizer, after checking its ids fit it")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing PREFIX.bin / .idx (with --record: a record of another tokenizer)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.record and (args.input or args.output_prefix):
        parser.error("--record writes records beside existing data: give it without --input / --output-prefix")
    if not args.record and not (args.input and args.output_prefix):
        parser.error("the following arguments are required: --input, --output-prefix (or --record PREFIX ...)")
    try:
        tokenizer = cli_tokenizer(args.tokenizer, args.tokenizer_type, args.vocab_file, args.merge_file)
        if args.record:
            for path in record_tokenizer(args.record, tokenizer, overwrite=args.overwrite):
                print(f"preprocess: {path} records {tokenizer_record(tokenizer)['tokenizer']}", file=sys.stderr)
            return 0
        preprocess(
            args.input,
            output_prefix=args.output_prefix,
            tokenizer=tokenizer,
            json_keys=args.json_keys,
            workers=max(1, args.workers),
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
