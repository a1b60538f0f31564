"""Data as components: a user's tokenizer and text-file provider selected by
`_target_` from overrides train at tp1pp1 and tp2pp2 with the same losses; held-out corpora
(`data.valid_prefixes`); `data.split` as a list; the tokenizer record of preprocessed data; the
start-up checks of `data`; and the reading rank's batch check at tp2 (one line on both ranks, no hang)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from harness import run_distributed
from mptrain.training.validate import validate_config
from mptrain.data import build_provider, build_tokenizer
from mptrain.data.gpt_dataset import split_document_ranges
from mptrain.data.preprocess import preprocess
from mptrain.data.provider import MockDataProvider
from mptrain.data.tokenizers import ByteTokenizer, unrecorded_note
from mptrain.errors import ConfigError
from mptrain_plugins.tokenizers import CharTokenizer
from test_data import shakespeare_docs
from train_utils import compose, read_rows, run_job

SEQ = 32
CHAR = "data.tokenizer._target_=mptrain_plugins.tokenizers.CharTokenizer"
TEXT = "data._target_=mptrain_plugins.text_data.TextFileProvider"


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    docs = shakespeare_docs()
    paths = []
    for i in range(2):
        path = root / f"play{i}.txt"
        path.write_text(docs[i]["text"][:6000], encoding="utf-8")
        paths.append(path)
    heldout = root / "heldout.txt"
    heldout.write_text(docs[5]["text"][:3000], encoding="utf-8")
    return {"root": root, "files": paths, "heldout": heldout}


def _text_overrides(texts, *extra) -> list:
    files = ",".join(str(p) for p in texts["files"])
    return ["model=tiny", "model.num_layers=2", f"model.seq_length={SEQ}", "data=shakespeare", TEXT, CHAR,
            f"+data.files=[{files}]", f"+data.valid_files=[{texts['heldout']}]", "train.train_iters=3",
            "train.eval_interval=2", "train.eval_iters=1", *extra]


# --- the user's tokenizer and provider, unit level ----------------------------------------------------
def test_char_tokenizer_round_trips_and_builds_from_target():
    tok = build_tokenizer({"tokenizer": {"_target_": "mptrain_plugins.tokenizers.CharTokenizer", "vocab": "abc "}})
    assert isinstance(tok, CharTokenizer) and (tok.vocab_size, tok.eod, tok.unk) == (6, 4, 5)
    assert tok.encode("cab a") == [2, 0, 1, 3, 0] and tok.decode(tok.encode("cab a") + [tok.eod]) == "cab a"
    assert tok.encode("ax") == [0, 5] and tok.decode([0, 5]) == "a\ufffd"
    full = CharTokenizer()
    text = shakespeare_docs()[0]["text"][:2000]
    assert full.decode(full.encode(text)) == text  # the shipped text is in the default vocabulary
    with pytest.raises(ConfigError, match=r"^data.tokenizer: mptrain_plugins.tokenizers.CharTokenizer rejected its "
                                          r"arguments \(ValueError: vocab must be non-empty"):
        build_tokenizer({"tokenizer": {"_target_": "mptrain_plugins.tokenizers.CharTokenizer", "vocab": "aa"}})


def _text_provider(texts, *, dp=1, r=0, mbs=2, shuffle=True, seed=5):
    return build_provider({"_target_": "mptrain_plugins.text_data.TextFileProvider", "seed": seed,
                           "files": [str(p) for p in texts["files"]], "shuffle": shuffle, "split": "1,0,0"},
                          tokenizer=CharTokenizer(), seq_length=SEQ, micro_batch_size=mbs, global_batch_size=8,
                          dp_rank=r, dp_size=dp, needs_data=True)


def test_text_provider_windows_order_sharding_and_resume(texts):
    tok = CharTokenizer()
    stream = []
    for p in texts["files"]:
        stream += tok.encode(p.read_text(encoding="utf-8")) + [tok.eod]
    first = next(_text_provider(texts, shuffle=False).train_iterator(0))
    assert first["tokens"][0].tolist() == stream[:SEQ] and first["labels"][0].tolist() == stream[1:SEQ + 1]
    assert first["tokens"][1].tolist() == stream[SEQ:2 * SEQ]  # windows tile the stream
    assert tok.decode(first["tokens"][0].tolist()) == texts["files"][0].read_text()[:SEQ]
    # shuffled: 4 micro-batches of dp 1 = the union of dp 2's slices, and a resume continues the stream
    ref = _text_provider(texts, mbs=2)
    it = ref.train_iterator(0)
    straight = torch.cat([next(it)["tokens"] for _ in range(8)])  # 16 samples
    parts = [_text_provider(texts, dp=2, r=r, mbs=1).train_iterator(0) for r in (0, 1)]
    sharded = torch.cat([next(parts[r])["tokens"] for _ in range(8) for r in (0, 1)])
    assert torch.equal(sharded, straight)
    resumed = _text_provider(texts, mbs=2).train_iterator(8)
    assert torch.equal(torch.cat([next(resumed)["tokens"] for _ in range(4)]), straight[8:])
    assert ref.state_dict() == {"consumed_samples": 16}
    other_seed = next(_text_provider(texts, seed=6).train_iterator(0))["tokens"]
    assert not torch.equal(other_seed, straight[:2])


def test_text_provider_and_char_tokenizer_train_at_tp1pp1_and_tp2pp2_alike(texts, tmp_path):
    """Selected from overrides only; the same per-step losses at both layouts (DESIGN.md §3), valid rows on the held-out file."""
    runs = {}
    for parallel, world in (("tp1pp1", 1), ("tp2pp2", 4)):
        run_dir = tmp_path / parallel
        run_distributed(run_job, world, _text_overrides(texts, f"parallel={parallel}", f"run.dir={run_dir}"),
                        timeout_s=300)
        runs[parallel] = (read_rows(run_dir), read_rows(run_dir, "valid"))
    (train1, valid1), (train4, valid4) = runs["tp1pp1"], runs["tp2pp2"]
    assert [r["iteration"] for r in train1] == [1, 2, 3] and [r["iteration"] for r in valid1] == [0, 2, 3]
    for a, b in zip(train1 + valid1, train4 + valid4):
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
    vocab = CharTokenizer().vocab_size
    assert valid1[0]["lm_loss"] == pytest.approx(np.log(vocab), rel=0.05)  # untrained: ~uniform over the char ids
    assert train1[-1]["lm_loss"] < train1[0]["lm_loss"]


# --- held-out corpora, split spellings, the tokenizer record ------------------------------------------
@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A: English (the plays, 8 documents); B: lines of random digits (very different bytes)."""
    import json

    root = tmp_path_factory.mktemp("corpora")
    docs = shakespeare_docs()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d["text"][:4000]}) + "\n" for d in docs[:8]))
    rng = random.Random(0)
    digits = ["".join(rng.choice("0123456789") for _ in range(3000)) for _ in range(3)]
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in digits))
    out = {}
    for name in ("a", "b"):
        (out[name],) = preprocess([str(root / f"{name}.jsonl")], output_prefix=str(root / name), tokenizer=ByteTokenizer(),
                                  progress=False)
    out["root"] = root
    return out


def _indexed(*extra) -> list:
    return ["model=tiny", "model.num_layers=2", f"model.seq_length={SEQ}", "data=indexed", "train.train_iters=6",
            "train.eval_interval=6", "train.eval_iters=2", "optim.lr=3e-3", *extra]


def test_valid_prefixes_evaluate_on_the_held_out_corpus(corpora, tmp_path):
    from mptrain.training.run import run

    rows = {}
    for name, valid in (("heldout_b", corpora["b"]), ("heldout_a", corpora["a"])):
        run(compose(_indexed(f"data.train_prefixes=[{corpora['a']}]", f"data.valid_prefixes=[{valid}]",
                             f"data.cache_dir={tmp_path}/cache", f"run.dir={tmp_path}/{name}")))
        rows[name] = (read_rows(tmp_path / name), read_rows(tmp_path / name, "valid"), read_rows(tmp_path / name, "test"))
    (train_b, valid_b, test_b), (train_a, valid_a, _) = rows["heldout_b"], rows["heldout_a"]
    assert [r["lm_loss"] for r in train_b] == [r["lm_loss"] for r in train_a]  # the valid corpus does not touch training
    assert test_b == []  # no test_prefixes: no test rows
    log = (tmp_path / "heldout_b" / "train.log").read_text()
    assert "data.test_prefixes is empty: no test rows" in log and "data.split" not in log  # split is not used here
    assert [r["iteration"] for r in valid_b] == [0, 6]
    # after training on English, digits are far less likely than held-back English text
    assert valid_b[-1]["lm_loss"] > valid_a[-1]["lm_loss"] + 0.5, (valid_b, valid_a)
    # and the number is B's: a provider reading B as its valid corpus gives batches of digits only
    p = build_provider(compose(_indexed(f"data.train_prefixes=[{corpora['a']}]", f"data.valid_prefixes=[{corpora['b']}]",
                                        f"data.cache_dir={tmp_path}/cache")).data,
                       tokenizer=ByteTokenizer(), seq_length=SEQ, micro_batch_size=2, global_batch_size=8, dp_rank=0,
                       dp_size=1, needs_data=True)
    batch = next(p.eval_iterator("valid"))
    assert set(batch["tokens"].flatten().tolist()) <= set(b"0123456789") and not p.has_split("test")
    from mptrain.data.errors import DataError

    with pytest.raises(DataError, match=r"^data.test_prefixes is empty \(data=indexed\); set data.test_prefixes=\[PREFIX\]"):
        p.eval_iterator("test")


def test_split_as_list_or_string_and_corpus_rules(corpora):
    assert split_document_ranges([90, 8, 2], 100) == split_document_ranges("90,8,2", 100) == {
        "train": (0, 90), "valid": (90, 98), "test": (98, 100)}
    cfg = compose(["data=indexed", f"data.prefixes=[{corpora['a']}]", "data.split=[90,8,2]"])
    validate_config(cfg, 1)
    assert list(cfg.data.split) == [90, 8, 2]
    assert compose(["data=indexed", 'data.split="90,8,2"']).data.split == "90,8,2"
    bad = {
        (f"data.prefixes=[{corpora['a']}]", f"data.valid_prefixes=[{corpora['b']}]"):
            r"^data.prefixes and data.valid_prefixes exclude each other",
        (f"data.valid_prefixes=[{corpora['b']}]",): r"^data.valid_prefixes is set but data.train_prefixes is empty",
        (f"data.train_prefixes=[0.5,{corpora['a']},{corpora['b']}]",): r"^data.train_prefixes=\[0.5, .*: give \[prefix",
        ("data.split=[1,-1]",): r"^data.split=\[1, -1\]: give train,valid,test weights",
        (f"data.prefixes=[-0.5,{corpora['a']},1.5,{corpora['b']}]",):
            r"^data.prefixes: blend weights \[-0.5, 1.5\] must be positive; drop the prefix instead$",
        (f"data.train_prefixes=[0,{corpora['a']},1,{corpora['b']}]",):
            r"^data.train_prefixes: blend weights \[0.0, 1.0\] must be positive",
        (f"data.prefixes=[{corpora['a']}]", "data.split=[0,100,0]"):
            r"^data.split=\[0, 100, 0\] gives the train split no share; give it one, e.g. 'data.split=\"90,5,5\"'$",
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            validate_config(compose(["data=indexed", *overrides]), 1)
    with pytest.raises(ConfigError, match=r"^data.prefixes=\[.*\] is not used by data._target_=mptrain.data.provider."
                                          r"MockDataProvider \(it takes no 'prefixes'\)"):
        validate_config(compose([f"data.prefixes=[{corpora['a']}]"]), 1)


def test_preprocessed_data_read_with_another_tokenizer_is_one_error(corpora, tmp_path, capsys):
    from mptrain.training.run import run

    with pytest.raises(ConfigError, match=r"^data.tokenizer: .*/a was preprocessed with mptrain.data.tokenizers.ByteTokenizer "
                                          r"\(fingerprint byte\) but data.tokenizer is mptrain_plugins.tokenizers.CharTokenizer"):
        run(compose(_indexed(f"data.prefixes=[{corpora['a']}]", CHAR, "model.vocab_size=300", f"run.dir={tmp_path}/r")))
    # a file without the record (Megatron's preprocessing): accepted with one note
    import shutil

    for ext in (".bin", ".idx"):
        shutil.copy(corpora["a"] + ext, tmp_path / f"old{ext}")
    p = build_provider(compose(_indexed(f"data.prefixes=[{tmp_path / 'old'}]", "data.split=[8,0,0]")).data,
                       tokenizer=ByteTokenizer(), seq_length=SEQ, micro_batch_size=2, global_batch_size=8, dp_rank=0,
                       dp_size=1, needs_data=True)
    assert next(p.train_iterator(0))["tokens"].shape == (2, SEQ)
    assert capsys.readouterr().err == unrecorded_note([str(tmp_path / "old")]) + "\n"
    # every rank reads data (dp 2): the note is printed by rank 0 alone
    printed = run_distributed(_build_and_capture_stderr, 2, str(tmp_path / "old"))
    assert printed == [unrecorded_note([str(tmp_path / "old")]) + "\n", ""], printed


def _build_and_capture_stderr(rank: int, world: int, prefix: str) -> str:
    """What building an indexed provider on ``prefix`` prints to stderr on this rank (every rank reads data)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        p = build_provider(compose(_indexed(f"data.prefixes=[{prefix}]", "data.split=[8,0,0]")).data,
                           tokenizer=ByteTokenizer(), seq_length=SEQ, micro_batch_size=2, global_batch_size=8,
                           dp_rank=rank, dp_size=world, needs_data=True)
        next(p.train_iterator(0))
    return err.getvalue()


def test_bad_provider_targets_are_one_line_at_start_up(texts):
    cases = {
        "data._target_=nope.Provider": r"^data._target_=nope.Provider does not import",
        "data._target_=collections.OrderedDict": r"^data._target_=collections.OrderedDict is not a valid dataset provider: "
                                                 r"it lacks train_iterator, eval_iterator, has_split, state_dict",
        "data._target_=test_data_components.NoRuntime": r"^data._target_=test_data_components.NoRuntime does not take the "
                                                        r"runtime keyword\(s\) seq_length, micro_batch_size",
        "+data.bogus=1": r"^data.bogus: mptrain.data.provider.MockDataProvider takes no keyword 'bogus'",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            validate_config(compose([override]), 1)


class NoRuntime:
    """A provider class whose __init__ forgets the runtime keywords."""

    def __init__(self, *, tokenizer):
        pass

    def train_iterator(self, consumed_samples): ...

    def eval_iterator(self, split): ...

    def has_split(self, split): ...

    def state_dict(self): ...


# --- the reading rank's batch check --------------------------------------------------------------------
class ShortProvider(MockDataProvider):
    """Mock data whose training batches are one token short (a provider bug)."""

    def train_iterator(self, consumed_samples):
        for batch in super().train_iterator(consumed_samples):
            yield None if batch is None else {k: v[:, :-1] if v is not None else v for k, v in batch.items()}


def _run_catching(rank, world, overrides):
    from mptrain.training.run import run

    try:
        run(compose(overrides))
    except ConfigError as err:
        return str(err)
    return "no error"


def test_wrong_shaped_batch_at_tp2_is_one_line_on_both_ranks(tmp_path):
    overrides = ["parallel=tp2pp1", "train.train_iters=2", "train.eval_interval=null",
                 "data._target_=test_data_components.ShortProvider", f"run.dir={tmp_path}/r"]
    out = run_distributed(_run_catching, 2, overrides, timeout_s=120)
    line = ("data._target_=test_data_components.ShortProvider yielded a bad micro-batch: tokens has shape [2, 63], "
            "expected [2, 64] (train.micro_batch_size × model.seq_length = 2 × 64)")
    assert out[0] == line
    assert out[1] == f"{line} (read by TP rank 0, global rank 0, of this TP group)"
    assert "\n" not in out[1]
