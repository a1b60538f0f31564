"""Corpus → indexed dataset (after Megatron's `tools/preprocess_data.py`).

    python -m mptrain.data.preprocess --input corpus.jsonl[.gz] [more ...] --json-keys text \\
        --tokenizer byte|hf:PATH|tiktoken:NAME|null:N|class:module.Class --output-prefix out --workers 2 [--overwrite]

Inputs: JSON Lines (`.jsonl`, `.json`, optionally `.gz`): one object per line, the text under
each `--json-keys` key, one document per line (blank lines are skipped); any other file
(`.txt`, optionally `.gz`) is one document. Each document becomes one sequence: its tokens
followed by the tokenizer's EOD. One key writes `<prefix>.bin/.idx`; several keys write
`<prefix>_<key>.bin/.idx` each (Megatron's naming). Existing outputs are refused unless
`--overwrite`; outputs are written to temporary files renamed at the end (`IndexedDatasetWriter`).
Beside each index goes `<prefix>.tokenizer.json` (the tokenizer's class, fingerprint, vocab_size
and eod; `mptrain.data.tokenizers.write_tokenizer_record`): reading the data with another
tokenizer is then one `ConfigError` naming `data.tokenizer`. The .idx stays Megatron's format.

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
from mptrain.data.indexed import IndexedDatasetWriter, token_dtype
from mptrain.data.tokenizers import Tokenizer, encode_array, parse_cli_tokenizer, write_tokenizer_record
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mptrain.data.preprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL(.gz) files (one document per line, its --json-keys) or text files (each file one "
                             "document: split a text into files, or into JSONL lines, for several)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="JSONL keys to tokenize, each into its own dataset PREFIX_KEY when several (default: text)")
    parser.add_argument("--tokenizer", default="byte", help="byte | hf:PATH[:EOD_TOKEN] | tiktoken:NAME | null:N | class:module.Class")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx (data.prefixes=[PREFIX])")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin / .idx")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        preprocess(
            args.input,
            output_prefix=args.output_prefix,
            tokenizer=parse_cli_tokenizer(args.tokenizer),
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
