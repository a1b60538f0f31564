"""Memory-mapped indexed dataset: `<prefix>.bin` (tokens) + `<prefix>.idx` (the index).

The on-disk format is Megatron's `MMIDIDX` version 1 (`megatron/core/datasets/indexed_dataset.py`),
so datasets written by Megatron's `tools/preprocess_data.py` load here and vice versa::

    .idx: b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence_count S | <Q document_count D
          | int32 sequence_lengths[S] (tokens) | int64 sequence_pointers[S] (bytes into .bin)
          | int64 document_indices[D] (document d = sequences [document_indices[d], document_indices[d+1]);
            document_indices[0] = 0, D = number of documents + 1)
    .bin: the tokens of every sequence, back to back, in the dtype of the code

Our preprocessing writes one sequence per document (the text's tokens followed by EOD), as Megatron's
`tools/preprocess_data.py` does without `--split-sentences`. Token dtype by vocabulary (Megatron's
rule): uint16 below 65500 ids, int32 otherwise.

The unit GPT training samples, shuffles and cuts by `data.split` is the **sequence**, as in Megatron
(`GPTDataset.numel_low_level_dataset`: "For GPT, the underlying IndexedDataset should be split by
sequence"): a Megatron dataset made with `--split-sentences` (one sequence per sentence) is read
sentence by sentence there and here alike. Below, a "document" of `IndexedDataset` is one sequence.

`IndexedDataset` checks both files against each other when opened (a missing, truncated or
overlong file raises `DataError` naming the file and the fix) and reads tokens through
`np.memmap`, so opening costs nothing and pages are read on demand.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Optional

import numpy as np

from mptrain.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
FIX = "re-create it with `python -m mptrain.data.preprocess --input CORPUS --output-prefix PREFIX --overwrite`"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDatasetWriter:
    """Write `<prefix>.bin` / `<prefix>.idx` through temporary files renamed at `finalize()`.

    An interrupted run leaves only `*.tmp-<pid>` files (removed by `abort()`, which the context
    manager calls on an exception), never a dataset that looks complete. The `.idx` is renamed
    last, so a present `.idx` implies a complete `.bin`.

    Args:
        prefix: output path without extension.
        dtype: token dtype (`token_dtype(vocab_size)`).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = Path(f"{self.prefix}.bin{suffix}")
        self._idx_tmp = Path(f"{self.prefix}.idx{suffix}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """Append one document (already ending with EOD) as one sequence."""
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids outside {self.dtype}: min {arr.min()}, max {arr.max()}")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))
        self.num_tokens += int(arr.size)

    def finalize(self) -> None:
        """Write the index and rename both temporary files into place (.bin first, .idx last)."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * self.dtype.itemsize
        doc_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(doc_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_indices.tobytes())
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        os.replace(self._idx_tmp, f"{self.prefix}.idx")

    def abort(self) -> None:
        """Close and delete the temporary files."""
        self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class IndexedDataset:
    """Read-only view of `<prefix>.bin` / `<prefix>.idx` (np.memmap).

    Attributes:
        num_documents: documents in the file: its sequences, the unit GPT samples and splits by (module docstring).
        doc_lengths: int64 [num_documents], tokens per document (EOD included).
        dtype: token dtype.
        num_tokens: total tokens.
    Raises:
        DataError: a missing file, a bad magic/version, or a `.idx` / `.bin` whose size does not
            match the header (truncated or overlong), naming the file and the fix.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        if not idx_path.is_file() and not bin_path.is_file():  # a prefix that names no dataset: a wrong path
            raise DataError(f"{idx_path}: no such file (indexed dataset {prefix}); fix the prefix in data.prefixes "
                            "(or data.train_prefixes / valid / test), or create the dataset with `python -m "
                            "mptrain.data.preprocess --input CORPUS --output-prefix PREFIX`")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise DataError(f"{p}: no such file (indexed dataset {prefix}); {FIX}")
        idx_size = idx_path.stat().st_size
        if idx_size < _HEADER.size:
            raise DataError(f"{idx_path}: truncated ({idx_size} bytes, header needs {_HEADER.size}); {FIX}")
        with open(idx_path, "rb") as f:
            magic, version, code, n_seq, n_doc_idx = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC or version != VERSION or code not in DTYPE_CODES:
            raise DataError(f"{idx_path}: not an MMIDIDX v1 index (magic {magic!r}, version {version}); {FIX}")
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc_idx
        if idx_size != expected:
            state = "truncated" if idx_size < expected else "longer than its header says"
            raise DataError(f"{idx_path}: {state} ({idx_size} bytes, expected {expected}); {FIX}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        seq_lengths = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=off)
        seq_pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
        doc_indices = np.frombuffer(buf, dtype=np.int64, count=n_doc_idx, offset=off + 12 * n_seq)
        if n_doc_idx < 1 or doc_indices[0] != 0 or doc_indices[-1] != n_seq or np.any(np.diff(doc_indices) < 0):
            raise DataError(f"{idx_path}: document indices are inconsistent with {n_seq} sequences; {FIX}")
        bin_expected = int(seq_lengths.astype(np.int64).sum()) * self.dtype.itemsize
        bin_size = bin_path.stat().st_size
        if bin_size != bin_expected:
            state = "truncated" if bin_size < bin_expected else "longer than its index says"
            raise DataError(f"{bin_path}: {state} ({bin_size} bytes, index expects {bin_expected}); {FIX}")
        if n_seq and (seq_pointers[0] != 0 or np.any(np.diff(seq_pointers) != seq_lengths[:-1].astype(np.int64) * self.dtype.itemsize)):
            raise DataError(f"{idx_path}: sequence pointers are not contiguous; {FIX}")
        # GPT's unit is the sequence (Megatron splits and shuffles sequences); the document indices are checked
        # above but group nothing here. One sequence per document (preprocess's, Megatron's default) is the same.
        seq_cum = np.concatenate([[0], np.cumsum(seq_lengths.astype(np.int64))])
        self.doc_starts = seq_cum[:-1]  # int64 [num_documents], token offsets into .bin
        self.doc_lengths = seq_lengths.astype(np.int64)  # int64 [num_documents]
        self.num_documents = int(n_seq)
        self.num_tokens = int(seq_cum[-1])
        self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens else np.zeros(0, self.dtype)
        self.bin_path, self.idx_path = bin_path, idx_path

    def __len__(self) -> int:
        return self.num_documents

    def max_token_id(self) -> int:
        """The largest token id in the .bin (-1 when empty); one pass over the memory map."""
        return int(self._tokens.max()) if self.num_tokens else -1

    def get_document(self, doc: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens of document `doc` from `offset`, `length` of them (None: to its end), as a view."""
        start = int(self.doc_starts[doc]) + offset
        end = int(self.doc_starts[doc] + self.doc_lengths[doc]) if length is None else start + length
        return self._tokens[start:end]

    def tokens_at(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at token offsets `positions` into the .bin (int64, any shape; each in [0, num_tokens)):
        one gather over the memory map, same shape, the file's dtype."""
        return self._tokens[positions]

    def __getitem__(self, doc: int) -> np.ndarray:
        return self.get_document(doc)
