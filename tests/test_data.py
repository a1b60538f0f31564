"""Data, part 1: tokenizers, preprocessing (round trip, refusal to overwrite, bad input), indexed
dataset checks, splits, check_vocab_size, the shipped Shakespeare corpus."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np
import pytest

from mptrain.data.errors import DataError
from mptrain.data.gpt_dataset import split_document_ranges
from mptrain.data.indexed import IndexedDataset
from mptrain.data.preprocess import preprocess
from mptrain.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    NullTokenizer,
    build_tokenizer,
    check_vocab_size,
)
from mptrain.data.train_tokenizer import train_bpe
from mptrain.errors import ConfigError
from procs import run_python

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "data" / "shakespeare.jsonl.gz"


def shakespeare_docs() -> list[dict]:
    with gzip.open(SHIPPED, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def make_corpus(path: Path, *, num_docs: int = 8, chars: tuple[int, ...] = (1500, 700, 2300, 90, 1200, 1800, 900, 1100)) -> list[str]:
    """A small JSONL slice of the shipped corpus: `num_docs` plays cut to the given lengths (chars)."""
    docs = shakespeare_docs()
    texts = [docs[i]["text"][1000 : 1000 + chars[i % len(chars)]] for i in range(num_docs)]
    path.write_text("".join(json.dumps({"title": docs[i]["title"], "text": t}) + "\n" for i, t in enumerate(texts)))
    return texts


# --- tokenizers -----------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip_and_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    text = "To be, or not to be — that is the question:\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids + [tok.eod]) == text  # EOD is dropped by decode
    assert tok.encode_array(text).tolist() == ids


def tokenizer_from_spec(spec: dict):
    return build_tokenizer({"tokenizer": spec})


def test_null_tokenizer_and_target_errors():
    tok = tokenizer_from_spec({"_target_": "mptrain.data.tokenizers.NullTokenizer", "vocab_size": 50})
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod) == (50, 49)
    assert tok.encode("3 4 5") == [3, 4, 5] and tok.decode([3, 4]) == "3 4"
    assert isinstance(tokenizer_from_spec({"_target_": "mptrain.data.tokenizers.ByteTokenizer"}), ByteTokenizer)
    with pytest.raises(ConfigError, match=r"^data.tokenizer._target_=foo.Bar does not import"):
        tokenizer_from_spec({"_target_": "foo.Bar"})
    with pytest.raises(ConfigError, match=r"^data.tokenizer._target_=mptrain.data.tokenizers.Nope: module mptrain.data.tokenizers has no Nope"):
        tokenizer_from_spec({"_target_": "mptrain.data.tokenizers.Nope"})
    with pytest.raises(ConfigError, match=r"^data.tokenizer.vocab_size: mptrain.data.tokenizers.ByteTokenizer takes no keyword 'vocab_size'"):
        tokenizer_from_spec({"_target_": "mptrain.data.tokenizers.ByteTokenizer", "vocab_size": 3})
    with pytest.raises(ConfigError, match=r"^data.tokenizer._target_=collections.OrderedDict is not a valid tokenizer: it lacks encode, decode"):
        tokenizer_from_spec({"_target_": "collections.OrderedDict"})
    # methods present, attributes missing: found on the built instance
    with pytest.raises(ConfigError, match=r"^data.tokenizer._target_=test_data.NoVocab is not a valid tokenizer: its instance lacks vocab_size"):
        tokenizer_from_spec({"_target_": "test_data.NoVocab"})
    with pytest.raises(ConfigError, match="^data.tokenizer is null; set data.tokenizer._target_"):
        build_tokenizer({"name": "indexed", "tokenizer": None})


class NoVocab:
    """Has the methods of a tokenizer but no vocab_size / eod / fingerprint."""

    def encode(self, text):
        return []

    def decode(self, ids):
        return ""


def test_tiktoken_without_local_files_is_a_clear_error():
    # tiktoken is not installed in this venv: the error must say so and name the alternatives.
    try:
        import tiktoken  # noqa: F401

        pytest.skip("tiktoken installed: the offline error path is not reachable here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="TiktokenTokenizer needs the `tiktoken` package"):
        tokenizer_from_spec({"_target_": "mptrain.data.tokenizers.TiktokenTokenizer", "encoding": "gpt2"})


def test_check_vocab_names_vocab_size():
    tok = ByteTokenizer()
    assert check_vocab_size(None, tok.vocab_size) == 257
    assert check_vocab_size(300, tok.vocab_size) == 300
    with pytest.raises(ConfigError, match=r"model.vocab_size=200 is smaller than the tokenizer's 257 ids"):
        check_vocab_size(200, tok.vocab_size)
    # the model's vocabulary from the checkpoint (use_checkpoint_args): the fix is the tokenizer's side
    with pytest.raises(ConfigError, match=r"^model.vocab_size=200 \(the checkpoint's, checkpoint.use_checkpoint_args\) "
                                          r"is smaller than the tokenizer's 257 ids; use the checkpoint's tokenizer or "
                                          r"one of at most 200 ids \(data=mock: data.vocab_size<=200\)$"):
        check_vocab_size(200, tok.vocab_size, from_checkpoint=True)


# --- preprocessing round trip ---------------------------------------------------------------------
# workers=2: a spawned process pool (an integration test; tests/conftest.py cannot tell the two apart)
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.integration)])
def test_preprocess_round_trip_byte(tmp_path, workers):
    texts = make_corpus(tmp_path / "c.jsonl")
    tok = ByteTokenizer()
    (prefix,) = preprocess([str(tmp_path / "c.jsonl")], output_prefix=str(tmp_path / "out"), tokenizer=tok, workers=workers, progress=False)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    for d, text in enumerate(texts):
        assert ds[d].tolist() == tok.encode(text) + [tok.eod]
    assert ds.num_tokens == sum(len(t.encode()) + 1 for t in texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out.bin", "out.idx", "out.tokenizer.json"]  # no temp files left


def test_preprocess_round_trip_hf_bpe_gz_and_text_file(tmp_path):
    texts = make_corpus(tmp_path / "c.jsonl")
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
        f.write((tmp_path / "c.jsonl").read_bytes())
    vocab = train_bpe([str(tmp_path / "c.jsonl.gz")], output=str(tmp_path / "tok.json"), vocab_size=300)
    tok = HFTokenizer(str(tmp_path / "tok.json"))
    assert vocab == tok.vocab_size == 300 and tok.eod == 0  # <|endoftext|> is the first special token
    (prefix,) = preprocess([str(tmp_path / "c.jsonl.gz")], output_prefix=str(tmp_path / "hf"), tokenizer=tok, progress=False)
    ds = IndexedDataset(prefix)
    for d, text in enumerate(texts):
        assert ds[d].tolist() == tok.encode(text) + [tok.eod]
        assert tok.decode(ds[d][:-1].tolist()) == text  # byte-level BPE is lossless
    (tmp_path / "play.txt").write_text(texts[2])
    (prefix,) = preprocess([str(tmp_path / "play.txt")], output_prefix=str(tmp_path / "txt"), tokenizer=tok, progress=False)
    ds = IndexedDataset(prefix)
    assert len(ds) == 1 and ds[0].tolist() == tok.encode(texts[2]) + [tok.eod]


def test_preprocess_several_keys_write_one_dataset_each(tmp_path):
    make_corpus(tmp_path / "c.jsonl", num_docs=3)
    tok = ByteTokenizer()
    prefixes = preprocess([str(tmp_path / "c.jsonl")], output_prefix=str(tmp_path / "o"), tokenizer=tok, json_keys=["title", "text"], progress=False)
    assert prefixes == [str(tmp_path / "o_title"), str(tmp_path / "o_text")]
    titles = [json.loads(line)["title"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    ds = IndexedDataset(prefixes[0])
    assert [ds[i].tolist() for i in range(3)] == [tok.encode(t) + [256] for t in titles]


def test_preprocess_refuses_to_overwrite(tmp_path):
    make_corpus(tmp_path / "c.jsonl", num_docs=2)
    args = dict(output_prefix=str(tmp_path / "out"), tokenizer=ByteTokenizer(), progress=False)
    preprocess([str(tmp_path / "c.jsonl")], **args)
    before = (tmp_path / "out.bin").read_bytes()
    make_corpus(tmp_path / "c2.jsonl", num_docs=3)
    with pytest.raises(DataError, match=r"out.bin exists; pass --overwrite"):
        preprocess([str(tmp_path / "c2.jsonl")], **args)
    assert (tmp_path / "out.bin").read_bytes() == before
    preprocess([str(tmp_path / "c2.jsonl")], overwrite=True, **args)
    assert len(IndexedDataset(tmp_path / "out")) == 3


def test_cli_error_is_one_line_exit_1(tmp_path):
    make_corpus(tmp_path / "c.jsonl", num_docs=1)
    cmd = ["-m", "mptrain.data.preprocess", "--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "o"), "--quiet"]
    assert run_python(cmd).returncode == 0
    res = run_python(cmd)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [f"error: {tmp_path / 'o'}.bin exists; pass --overwrite to replace it or choose another --output-prefix"]


# --- bad input ------------------------------------------------------------------------------------
def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "a"}', '{"text": "b"', '{"text": "c"}'], r"c.jsonl:2: not valid JSON \(.*\); fix: one JSON object per line"),
        (['{"text": "a"}', "", '{"body": "b"}'], r"c.jsonl:3: no key 'text' \(keys: \['body'\]\); fix --json-keys"),
        (['{"text": 3}'], r"c.jsonl:1: key 'text' holds a int, not a string"),
        (['["text"]'], r"c.jsonl:1: a JSON list, not an object"),
        (["", "   "], r"c.jsonl: empty corpus \(no documents\)"),
        (['{"text": ""}', '{"text": ""}'], r"c.jsonl: empty corpus \(2 documents, all empty text\)"),
    ],
)
def test_bad_corpus_errors_and_no_partial_output(tmp_path, lines, message):
    corpus = _write(tmp_path / "c.jsonl", lines)
    with pytest.raises(DataError, match=message):
        preprocess([corpus], output_prefix=str(tmp_path / "out"), tokenizer=ByteTokenizer(), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # temp files removed, nothing renamed


def test_missing_and_truncated_files(tmp_path):
    make_corpus(tmp_path / "c.jsonl", num_docs=3)
    (prefix,) = preprocess([str(tmp_path / "c.jsonl")], output_prefix=str(tmp_path / "out"), tokenizer=ByteTokenizer(), progress=False)
    idx, bin_ = Path(prefix + ".idx").read_bytes(), Path(prefix + ".bin").read_bytes()
    with pytest.raises(DataError) as err:  # no file of the prefix: a wrong path, named as the key that holds it
        IndexedDataset(tmp_path / "nope")
    assert str(err.value) == (f"{tmp_path}/nope.idx: no such file (indexed dataset {tmp_path}/nope); fix the prefix in "
                              "data.prefixes (or data.train_prefixes / valid / test), or create the dataset with "
                              "`python -m mptrain.data.preprocess --input CORPUS --output-prefix PREFIX`")
    Path(prefix + ".bin").write_bytes(bin_[:-2])
    with pytest.raises(DataError, match=rf"out.bin: truncated \({len(bin_) - 2} bytes, index expects {len(bin_)}\)"):
        IndexedDataset(prefix)
    Path(prefix + ".bin").write_bytes(bin_ + b"\0\0")
    with pytest.raises(DataError, match=r"out.bin: longer than its index says"):
        IndexedDataset(prefix)
    Path(prefix + ".bin").write_bytes(bin_)
    Path(prefix + ".idx").write_bytes(idx[:-8])
    with pytest.raises(DataError, match=rf"out.idx: truncated \({len(idx) - 8} bytes, expected {len(idx)}\)"):
        IndexedDataset(prefix)
    Path(prefix + ".idx").write_bytes(idx[:20])
    with pytest.raises(DataError, match=r"out.idx: truncated \(20 bytes, header needs 34\)"):
        IndexedDataset(prefix)
    Path(prefix + ".idx").write_bytes(b"X" * len(idx))
    with pytest.raises(DataError, match=r"out.idx: not an MMIDIDX v1 index"):
        IndexedDataset(prefix)
    Path(prefix + ".bin").unlink()
    with pytest.raises(DataError, match=r"out.bin: no such file \(indexed dataset .*out\); re-create it with"):
        IndexedDataset(prefix)


# --- splits ----------------------------------------------------------------------------------------
def test_split_document_ranges_table():
    assert split_document_ranges("969,30,1", 42) == {"train": (0, 41), "valid": (41, 42), "test": (42, 42)}
    assert split_document_ranges("90,5,5", 42) == {"train": (0, 38), "valid": (38, 40), "test": (40, 42)}
    assert split_document_ranges("6,1,1", 8) == {"train": (0, 6), "valid": (6, 7), "test": (7, 8)}
    assert split_document_ranges("1", 5) == {"train": (0, 5), "valid": (5, 5), "test": (5, 5)}
    assert split_document_ranges("969/30/1", 1000) == {"train": (0, 969), "valid": (969, 999), "test": (999, 1000)}
    for bad in ("", "a,b", "1,-1,0", "0,0,0", "1,1,1,1"):
        with pytest.raises(ConfigError, match="data.split="):
            split_document_ranges(bad, 10)


# --- the shipped corpus ----------------------------------------------------------------------------
def test_shipped_corpus_preprocesses_fully(tmp_path):
    docs = shakespeare_docs()
    assert len(docs) == 42 and docs[0]["title"] == "alls_well_that_ends_well"
    t0 = time.monotonic()
    (prefix,) = preprocess([str(SHIPPED)], output_prefix=str(tmp_path / "shk"), tokenizer=ByteTokenizer(), workers=1, progress=False)
    elapsed = time.monotonic() - t0  # reported, not asserted (timings are noisy on shared CPUs)
    ds = IndexedDataset(prefix)
    assert len(ds) == 42
    assert ds.doc_lengths.tolist() == [len(d["text"].encode()) + 1 for d in docs]
    assert ds[41][-1] == 256 and bytes(ds[41][:30].astype(np.uint8)).decode() == docs[41]["text"].encode()[:30].decode()
    print(f"full corpus preprocessed in {elapsed:.2f} s")


def test_mock_data_has_the_splits_data_split_weighs():
    """data=mock follows data.split as Megatron's mock datasets do: a split of weight 0 has no data (its evaluation
    is skipped; reading it is one line); the others are the seeded mock sequences, whatever their weight."""
    from mptrain.data.provider import MockDataProvider

    def provider(split):
        return MockDataProvider(vocab_size=100, tokenizer=ByteTokenizer(), seq_length=8, micro_batch_size=2,
                                global_batch_size=4, dp_rank=0, dp_size=1, needs_data=True, split=split)

    p = provider("99,1,0")
    assert [p.has_split(s) for s in ("train", "valid", "test")] == [True, True, False]
    batch = next(iter(p.eval_iterator("valid")))
    assert batch["tokens"].shape == (2, 8)
    with pytest.raises(DataError, match=r"^data.split='99,1,0' leaves the test split no documents \(data=mock\)"):
        next(iter(p.eval_iterator("test")))
    assert [provider([1, 1, 1]).has_split(s) for s in ("train", "valid", "test")] == [True, True, True]
