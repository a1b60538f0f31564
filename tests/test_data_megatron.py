"""Megatron-LM's data in mptrain: the GPT2BPETokenizer (GPT-2's vocab.json + merges.txt) against transformers'
GPT-2 tokenizers, preprocessing with Megatron's tokenizer flags, and a .bin/.idx pair written as Megatron's
``IndexedDatasetBuilder`` writes it (no tokenizer record) read sequence by sequence with one note.

tests/fixtures/gpt2_bpe/{vocab.json,merges.txt}: a GPT-2-format byte-level BPE (256 byte symbols and 128
merges trained on 6 KB of the shipped corpus with `tokenizers`, ``<|endoftext|>`` appended as the last id, as
GPT-2's 50256).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mptrain.data import build_provider, build_tokenizer
from mptrain.data.indexed import IndexedDataset
from mptrain.data.preprocess import main as preprocess_main
from mptrain.data.tokenizers import GPT2BPETokenizer, unrecorded_note
from mptrain.errors import ConfigError

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gpt2_bpe"
VOCAB, MERGES = str(FIXTURE / "vocab.json"), str(FIXTURE / "merges.txt")

TEXTS = [
    "To be, or not to be: that is the question.",
    "  two leading spaces, three   inside and a trailing one ",
    "lines\nand\n\nblank lines\r\nwith CRLF\tand a tab\n",
    "digits 12345 and 3.14159, year 1600; 007",
    "contractions: don't I'm we'll they've she'd it's DON'T O'er",
    "unicode: café naïve — “quotes” 日本語 Ελληνικά emoji 🎭👑 and ℕ",
    "",
    " ",
    "\n",
    "ALL CAPS SHOUTING!!! ...?!",
]


def _gpt2_tokenizer():
    return build_tokenizer({"tokenizer": {"_target_": "mptrain.data.tokenizers.GPT2BPETokenizer",
                                          "vocab_file": VOCAB, "merge_file": MERGES}})


# Megatron's GPT-2 split (megatron/training/tokenizer/gpt2_tokenization.py, from OpenAI's encoder.py)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def megatron_gpt2_encode(text: str, vocab: dict, merges_text: str) -> list:
    """Megatron's ``GPT2Tokenizer.encode`` in plain Python: the regex split, each piece's UTF-8 bytes as GPT-2's
    characters, then the lowest-ranked adjacent pair merged until none is in the merges (its ``bpe``)."""
    import regex

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    byte_char = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    ranks = {tuple(line.split()): r for r, line in enumerate(merges_text.split("\n")[1:-1])}  # after the #version line
    ids = []
    for piece in regex.findall(GPT2_PATTERN, text):
        word = [byte_char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = min(zip(word, word[1:]), key=lambda pair: ranks.get(pair, len(ranks)))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids += [vocab[token] for token in word]
    return ids


def test_gpt2_bpe_ids_equal_megatrons_and_transformers_gpt2_tokenizer():
    from transformers import GPT2Tokenizer

    tok = _gpt2_tokenizer()
    vocab = json.loads(Path(VOCAB).read_text(encoding="utf-8"))
    merges = Path(MERGES).read_text(encoding="utf-8")
    assert isinstance(tok, GPT2BPETokenizer)
    assert (tok.vocab_size, tok.eod) == (len(vocab), vocab["<|endoftext|>"]) == (385, 384)
    hf = GPT2Tokenizer(VOCAB, MERGES)  # (vocab_file, merges_file): positional in transformers 4 and 5 alike
    assert (len(hf), hf.eos_token_id) == (tok.vocab_size, tok.eod)
    merged = 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == megatron_gpt2_encode(text, vocab, merges), text
        assert ids == hf(text, add_special_tokens=False)["input_ids"], text
        assert tok.encode_array(text).tolist() == ids
        assert tok.decode(ids) == text  # byte-level: lossless
        merged += len(ids) < len(text.encode("utf-8"))
    assert merged >= 5  # the merges apply (ids are not the bytes alone)
    # <|endoftext|> written in a text is text (Megatron's tokenizer registers no special token), as transformers'
    # split_special_tokens=True; decode renders the EOD id as that token
    text = "end<|endoftext|>next"
    ids = tok.encode(text)
    assert tok.eod not in ids
    assert ids == megatron_gpt2_encode(text, vocab, merges) == hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tok.decode([*tok.encode("end"), tok.eod]) == "end<|endoftext|>"


def test_gpt2_bpe_fingerprint_is_the_mapping_and_errors_name_the_key(tmp_path):
    tok = _gpt2_tokenizer()
    assert tok.fingerprint.startswith("gpt2bpe:")
    vocab = json.loads(Path(VOCAB).read_text(encoding="utf-8"))
    # the same mapping written another way: same fingerprint
    (tmp_path / "v.json").write_text(json.dumps(dict(reversed(vocab.items())), indent=2), encoding="utf-8")
    assert GPT2BPETokenizer(str(tmp_path / "v.json"), MERGES).fingerprint == tok.fingerprint
    # one merge fewer: another mapping, another fingerprint
    lines = Path(MERGES).read_text(encoding="utf-8").splitlines()
    (tmp_path / "m.txt").write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
    assert GPT2BPETokenizer(VOCAB, str(tmp_path / "m.txt")).fingerprint != tok.fingerprint
    with pytest.raises(ConfigError, match=r"^data.tokenizer.merge_file=.*/nope.txt: no such file; give GPT-2's file "
                                          r"\(Megatron's --merge-file"):
        GPT2BPETokenizer(VOCAB, str(tmp_path / "nope.txt"))
    del vocab["<|endoftext|>"]
    (tmp_path / "no_eod.json").write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"no '<\|endoftext\|>' token"):
        GPT2BPETokenizer(str(tmp_path / "no_eod.json"), MERGES)


def test_preprocess_takes_megatrons_tokenizer_flags(tmp_path, capsys):
    tok = _gpt2_tokenizer()
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS if t.strip()))
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]
    assert preprocess_main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "g"), *flags, "--quiet"]) == 0
    ds = IndexedDataset(tmp_path / "g")
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) + [tok.eod] for t in TEXTS if t.strip()]
    record = json.loads((tmp_path / "g.tokenizer.json").read_text())
    assert record == {"tokenizer": "mptrain.data.tokenizers.GPT2BPETokenizer", "fingerprint": tok.fingerprint,
                      "vocab_size": 385, "eod": 384}
    capsys.readouterr()
    bad = {("--tokenizer-type", "HuggingFaceTokenizer"): "--tokenizer-type HuggingFaceTokenizer: only GPT2BPETokenizer",
           ("--tokenizer", "byte", "--vocab-file", VOCAB): "--tokenizer byte with --tokenizer-type / --vocab-file",
           ("--vocab-file", VOCAB): "GPT2BPETokenizer needs --vocab-file and --merge-file"}
    for extra, message in bad.items():
        assert preprocess_main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "x"), *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.idx").exists()


def write_like_megatron(prefix: Path, documents: list, dtype=np.uint16) -> None:
    """``documents`` (each a list of sequences of ids) as Megatron-core's ``IndexedDatasetBuilder.add_document`` +
    ``finalize`` write them (megatron/core/datasets/indexed_dataset.py, ``_IndexWriter``): the .bin the tokens back
    to back; the .idx the header, version 1, the dtype code, the sequence count, the document-index count, int32
    sequence lengths, int64 byte pointers, int64 document indices (starting at 0)."""
    code = {np.uint16: 8, np.int32: 4}[dtype]
    lengths, document_indices = [], [0]
    with open(f"{prefix}.bin", "wb") as f:
        for sequences in documents:
            f.write(np.array([t for s in sequences for t in s], dtype=dtype).tobytes(order="C"))
            lengths.extend(len(s) for s in sequences)
            document_indices.append(len(lengths))
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]) * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices)))
        f.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        f.write(np.array(document_indices, dtype=np.int64).tobytes(order="C"))


def _provider(prefix, tokenizer, **data):
    cfg = {"_target_": "mptrain.data.provider.IndexedDataProvider", "prefixes": [str(prefix)], "split": "50,50,0", **data}
    return build_provider(cfg, tokenizer=tokenizer, seq_length=8, micro_batch_size=1, global_batch_size=1, dp_rank=0,
                          dp_size=1, needs_data=True)


def test_megatron_written_data_reads_by_sequence_with_one_note(tmp_path, capsys):
    tok = _gpt2_tokenizer()
    # preprocess_data.py --append-eod: the EOD ends each document; --split-sentences: document 0 is two sequences
    s0, s1 = tok.encode("To be, or not to be:"), tok.encode(" that is the question.") + [tok.eod]
    s2 = tok.encode("Whether 'tis nobler in the mind to suffer") + [tok.eod]
    s3 = tok.encode("The slings and arrows of outrageous fortune") + [tok.eod]
    prefix = tmp_path / "megatron_text_document"
    write_like_megatron(prefix, [[s0, s1], [s2], [s3]])
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and [ds[i].tolist() for i in range(4)] == [s0, s1, s2, s3]
    capsys.readouterr()
    p = _provider(prefix, tok, cache_dir=str(tmp_path / "cache"))
    err = capsys.readouterr().err
    assert err == unrecorded_note([str(prefix)]) + "\n"
    assert err.startswith(f"data: {prefix} has no .tokenizer.json (Megatron's preprocessing writes none): token ids "
                          "are checked against data.tokenizer's vocab_size only") and "warning" not in err
    # data.split cuts sequences, as Megatron's GPTDataset: 50,50 of 4 sequences gives valid sequences 2 and 3
    # (by document it would be document 2 alone, s3)
    batch = next(p.eval_iterator("valid"))
    assert batch["tokens"][0].tolist() == (s2 + s3)[:8]
    # record the tokenizer beside the data: read again without a line; another tokenizer is then refused
    assert preprocess_main(["--record", str(prefix), "--vocab-file", VOCAB, "--merge-file", MERGES]) == 0
    assert json.loads((tmp_path / "megatron_text_document.tokenizer.json").read_text())["fingerprint"] == tok.fingerprint
    capsys.readouterr()
    _provider(prefix, tok, cache_dir=str(tmp_path / "cache"))
    assert capsys.readouterr().err == ""
    from mptrain.data.tokenizers import ByteTokenizer

    with pytest.raises(ConfigError, match=r"was preprocessed with mptrain.data.tokenizers.GPT2BPETokenizer"):
        _provider(prefix, ByteTokenizer())


def test_record_checks_ids_and_an_existing_record(tmp_path, capsys):
    tok = _gpt2_tokenizer()
    a, b = tmp_path / "a", tmp_path / "b"
    write_like_megatron(a, [[list(range(100, 110))]])
    write_like_megatron(b, [[[5, 300, tok.eod, 7, 8, 9]]])
    # b's ids up to 384 do not fit a 257-id tokenizer: nothing is written, for either prefix
    assert preprocess_main(["--record", str(a), str(b), "--tokenizer", "byte"]) == 1
    assert "b.bin holds token id 384 but mptrain.data.tokenizers.ByteTokenizer has 257 ids" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.tokenizer.json"))
    # several prefixes without a record: one line for all
    capsys.readouterr()
    p = build_provider({"_target_": "mptrain.data.provider.IndexedDataProvider", "prefixes": [1, str(a), 1, str(b)],
                        "split": "1,0,0", "cache_dir": str(tmp_path / "cache")}, tokenizer=tok, seq_length=4,
                       micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1, needs_data=True)
    assert p.has_split("train")
    assert capsys.readouterr().err == unrecorded_note([str(a), str(b)]) + "\n"
    assert unrecorded_note([str(a), str(b)]).startswith(f"data: {a}, {b} have no .tokenizer.json")
    assert preprocess_main(["--record", str(a), "--vocab-file", VOCAB, "--merge-file", MERGES]) == 0
    # an existing record of another tokenizer is kept unless --overwrite
    assert preprocess_main(["--record", str(a), "--tokenizer", "null:400"]) == 1
    assert "records another tokenizer" in capsys.readouterr().err
    assert json.loads((tmp_path / "a.tokenizer.json").read_text())["fingerprint"] == tok.fingerprint
    assert preprocess_main(["--record", str(a), "--tokenizer", "null:400", "--overwrite"]) == 0
    assert json.loads((tmp_path / "a.tokenizer.json").read_text())["fingerprint"] == "null:400"


def test_hf_export_writes_the_gpt2_bpe_as_one_tokenizer_json(tmp_path):
    from transformers import AutoTokenizer

    from mptrain.hf.tokenizer import write_tokenizer_files

    spec = {"_target_": "mptrain.data.tokenizers.GPT2BPETokenizer", "vocab_file": VOCAB, "merge_file": MERGES}
    eod, written, notes = write_tokenizer_files({"name": "indexed", "tokenizer": spec}, tmp_path, model_max_length=64)
    tok, hf = _gpt2_tokenizer(), AutoTokenizer.from_pretrained(str(tmp_path))
    assert (eod, notes) == (384, []) and "tokenizer.json" in written
    assert (hf.eos_token_id, hf.bos_token_id) == (tok.eod, tok.eod)
    for text in TEXTS:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(text) and hf.decode(ids) == text, text
