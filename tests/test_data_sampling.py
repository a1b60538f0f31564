"""Data, part 2: GPTDataset epochs, blends, mock data, masks, the sampler and the shipped providers —
coverage of one epoch, the same global batches for any dp / micro-batch split and run length,
exact resume, determinism, and the collective construction on 2 gloo ranks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from harness import run_distributed
from mptrain.config.data import DataConfig
from mptrain.data import DataError, build_provider, build_tokenizer
from mptrain.data.provider import GPTDataProvider
from mptrain.data.blended import BlendedDataset, blend_indices
from mptrain.data.collate import collate, collate_arrays, read_samples
from mptrain.data.gpt_dataset import GPTDataset, split_document_ranges
from mptrain.data.indexed import IndexedDataset
from mptrain.data.mock import MockDataset
from mptrain.data.preprocess import preprocess
from mptrain.data.sampler import PretrainingSampler
from mptrain.data.tokenizers import ByteTokenizer
from mptrain.errors import ConfigError
from test_data import make_corpus, shakespeare_docs

SEQ = 16
KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two small indexed datasets sliced from the shipped plays: A (8 docs) and B (4 other docs)."""
    root = tmp_path_factory.mktemp("corpus")
    make_corpus(root / "a.jsonl")
    (a,) = preprocess([str(root / "a.jsonl")], output_prefix=str(root / "a"), tokenizer=ByteTokenizer(), progress=False)
    make_corpus(root / "b.jsonl", num_docs=4, chars=(400, 300, 500, 200))
    (b,) = preprocess([str(root / "b.jsonl")], output_prefix=str(root / "b"), tokenizer=ByteTokenizer(), progress=False)
    return {"a": a, "b": b, "root": root}


def _cfg(prefixes, **kw) -> DataConfig:
    return DataConfig(_target_=INDEXED, name="indexed", prefixes=list(prefixes), split="6,1,1", seed=7, tokenizer=BYTE, **kw)


INDEXED = "mptrain.data.provider.IndexedDataProvider"
BYTE = {"_target_": "mptrain.data.tokenizers.ByteTokenizer"}


def _provider(cfg, cache, *, dp=1, r=0, mbs=2, gbs=8, needs_data=True) -> GPTDataProvider:
    return build_provider(
        dataclasses.replace(cfg, cache_dir=str(cache)), tokenizer=build_tokenizer(cfg), seq_length=SEQ,
        micro_batch_size=mbs, global_batch_size=gbs, dp_rank=r, dp_size=dp, needs_data=needs_data,
    )


def global_batches(cfg, cache, *, dp, mbs, gbs=8, iters, consumed=0) -> list[dict]:
    """Each iteration's global batch: the union of every DP rank's micro-batches, in sample order
    (micro-step k, then rank r covers samples [k·b·d + r·b, k·b·d + (r+1)·b))."""
    its = [_provider(cfg, cache, dp=dp, r=r, mbs=mbs, gbs=gbs).train_iterator(consumed) for r in range(dp)]
    out = []
    for _ in range(iters):
        parts = [next(it) for _k in range(gbs // (mbs * dp)) for it in its]
        out.append({k: torch.cat([p[k] for p in parts]) for k in KEYS})
    return out


def assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for i, (x, y) in enumerate(zip(xs, ys)):
        for k in KEYS:
            assert torch.equal(x[k], y[k]), (i, k)  # exact: the same samples, bit for bit


# --- GPTDataset -----------------------------------------------------------------------------------
def test_one_epoch_covers_every_train_token_once_and_no_other_split(corpus, tmp_path):
    indexed = IndexedDataset(corpus["a"])
    ds = GPTDataset(indexed, doc_range=(0, 6), seq_length=SEQ, seed=7, split="train", shuffle=True, eod=256, cache_dir=tmp_path)
    doc_idx, _, shuffle_idx = ds.epoch_indices(0)
    assert sorted(doc_idx.tolist()) == [0, 1, 2, 3, 4, 5]  # only train documents (valid = 6, test = 7)
    stream = np.concatenate([indexed[d] for d in doc_idx]).astype(np.int64)  # the epoch's token stream
    T = len(stream)
    assert T == ds.num_tokens == int(indexed.doc_lengths[:6].sum())
    assert ds.num_samples_per_epoch == -(-(T - 1) // SEQ)
    input_hits, label_hits = np.zeros(T, dtype=int), np.zeros(T, dtype=int)
    for g in range(ds.num_samples_per_epoch):
        tokens, valid = ds.sample(g)
        epoch, pos = ds.stream_positions(g)
        assert epoch == 0 and tokens.shape == (SEQ + 1,)
        assert np.array_equal(tokens[valid], stream[pos[valid]])
        assert np.all(tokens[~valid] == 256) and np.array_equal(valid, pos >= 0)
        learn = valid[1:]  # a position is trained iff its label is real
        np.add.at(input_hits, pos[:-1][learn], 1)
        np.add.at(label_hits, pos[1:][learn], 1)
    assert input_hits[: T - 1].tolist() == [1] * (T - 1) and input_hits[T - 1] == 0
    assert label_hits[0] == 0 and label_hits[1:].tolist() == [1] * (T - 1)
    assert not np.array_equal(shuffle_idx, np.arange(len(shuffle_idx)))  # train is shuffled


def test_later_epochs_and_longer_runs_extend_the_same_order(corpus, tmp_path):
    indexed = IndexedDataset(corpus["a"])
    kw = dict(doc_range=(0, 6), seq_length=SEQ, seed=7, split="train", shuffle=True, eod=256)
    ds = GPTDataset(indexed, cache_dir=tmp_path / "c1", **kw)
    n = ds.num_samples_per_epoch
    order = [0, 5, n - 1, n, n + 3, 2 * n + 1, 3]
    ref = {g: ds.sample(g) for g in order}
    fresh = GPTDataset(indexed, cache_dir=None, **kw)  # no cache, asked in another order
    for g in reversed(order):
        t, v = fresh.sample(g)
        assert np.array_equal(t, ref[g][0]) and np.array_equal(v, ref[g][1])
    e0, e1 = ds.epoch_indices(0), ds.epoch_indices(1)
    assert sorted(e1[2].tolist()) == list(range(n))  # epoch 1 is a permutation too
    assert not np.array_equal(e0[2], e1[2]) or not np.array_equal(e0[0], e1[0])  # with a new order
    cached = GPTDataset(indexed, cache_dir=tmp_path / "c1", **kw)  # reads the files rank 0 would write
    files = sorted(p.name for p in cached.cache_path.iterdir())
    assert files == ["description.json"] + [f"epoch_{e:05d}_{k}.npy" for e in (0, 1, 2) for k in ("doc_idx", "sample_idx", "shuffle_idx")]
    for a, b in zip(cached.epoch_indices(1), e1):
        assert isinstance(a, np.memmap) and np.array_equal(a, b)
    other_seed = GPTDataset(indexed, cache_dir=tmp_path / "c1", **{**kw, "seed": 8})
    assert other_seed.cache_path != cached.cache_path


def test_eval_split_is_in_file_order(corpus):
    indexed = IndexedDataset(corpus["a"])
    ds = GPTDataset(indexed, doc_range=(6, 7), seq_length=SEQ, seed=7, split="valid", shuffle=False, eod=256)
    stream = indexed[6].astype(np.int64)
    for g in range(ds.num_samples_per_epoch):
        t, v = ds.sample(g)
        assert np.array_equal(t[v], stream[g * SEQ : g * SEQ + SEQ + 1])


# --- blend, mock, masks, sampler --------------------------------------------------------------------
def test_blend_table_and_prefix_property():
    k, m = blend_indices([0.75, 0.25], 8)
    assert k.tolist() == [0, 0, 1, 0, 0, 0, 1, 0] and m.tolist() == [0, 1, 0, 2, 3, 4, 1, 5]
    k1, m1 = blend_indices([3, 1, 0.5], 1000)
    k2, m2 = blend_indices([3, 1, 0.5], 5003)
    assert np.array_equal(k1, k2[:1000]) and np.array_equal(m1, m2[:1000])
    counts = np.bincount(k2)
    assert np.all(np.abs(counts - np.array([3, 1, 0.5]) / 4.5 * 5003) <= 1)  # apportionment: within 1 sample
    for j in range(3):
        assert m2[k2 == j].tolist() == list(range(counts[j]))  # each dataset read in order
    with pytest.raises(ConfigError, match="must be positive"):
        blend_indices([1, 0], 4)


def test_blended_provider_serves_component_samples(corpus, tmp_path):
    cfg = _cfg([0.75, corpus["a"], 0.25, corpus["b"]])
    p = _provider(cfg, tmp_path)
    blend = p.splits["train"]
    assert isinstance(blend, BlendedDataset)
    singles = [_provider(_cfg([corpus[x]]), tmp_path).splits["train"] for x in ("a", "b")]
    for i, (k, m) in enumerate(zip([0, 0, 1, 0, 0, 0, 1, 0], [0, 1, 0, 2, 3, 4, 1, 5])):
        assert np.array_equal(blend.sample(i)[0], singles[k].sample(m)[0])


def test_mock_data_deterministic_learnable_and_split_dependent(tmp_path):
    def first(seed, split="train", dp=1, r=0):
        cfg = DataConfig(name="mock", seed=seed, vocab_size=97, tokenizer={"_target_": "mptrain.data.tokenizers.NullTokenizer", "vocab_size": 97})
        p = _provider(cfg, tmp_path, dp=dp, r=r, mbs=4 // dp)
        it = p.train_iterator(0) if split == "train" else p.eval_iterator(split)
        return [next(it) for _ in range(3)]

    a, b, c = first(3), first(3), first(4)
    for x, y in zip(a, b):
        assert all(torch.equal(x[k], y[k]) for k in KEYS)
    assert not torch.equal(a[0]["tokens"], c[0]["tokens"])
    tr, va, te = a[0]["tokens"], first(3, "valid")[0]["tokens"], first(3, "test")[0]["tokens"]
    assert not torch.equal(tr, va) and not torch.equal(va, te) and not torch.equal(tr, te)
    for batch in a:
        t = batch["tokens"]
        assert int(t.max()) < 97 and int(t.min()) >= 0
        assert torch.equal(batch["labels"], (t + 1) % 97)  # consecutive ids mod vocab_size
        assert torch.equal(t[:, 1:], batch["labels"][:, :-1])
    halves = [first(3, dp=2, r=r)[0]["tokens"] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), a[0]["tokens"])  # dp 2 splits the same samples


def test_collate_masks_exact():
    E = 0
    sample = np.array([5, 6, E, 7, 8, E, 9, 10, 11])  # s = 8 inputs + 1
    valid = np.array([True] * 7 + [False] * 2)  # the last two tokens are padding
    b = collate([(sample, valid)], eod=E, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    assert b["tokens"].tolist() == [[5, 6, E, 7, 8, E, 9, 10]] and b["labels"].tolist() == [[6, E, 7, 8, E, 9, 10, 11]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0, 0, 0]]  # EOD inputs and padded labels masked
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    q, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    allowed = (k <= q) & (doc[k] == doc[q])
    assert b["attention_mask"].shape == (1, 1, 8, 8) and torch.equal(b["attention_mask"][0, 0], ~allowed)
    plain = collate([(sample, np.ones(9, bool))], eod=E)
    assert plain["attention_mask"] is None and plain["loss_mask"].tolist() == [[1.0] * 8]
    assert plain["position_ids"].tolist() == [list(range(8))] and plain["loss_mask"].dtype == torch.float32


def test_sampler_table_and_state():
    def take(dp, r, mbs, consumed, n):
        it = iter(PretrainingSampler(micro_batch_size=mbs, dp_rank=r, dp_size=dp, consumed_samples=consumed))
        return [next(it) for _ in range(n)]

    assert take(2, 0, 2, 0, 2) == [[0, 1], [4, 5]] and take(2, 1, 2, 0, 2) == [[2, 3], [6, 7]]
    assert take(1, 0, 4, 0, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert take(2, 1, 2, 8, 1) == [[10, 11]]
    s = PretrainingSampler(micro_batch_size=2, dp_rank=0, dp_size=2)
    it = iter(s)
    next(it), next(it), next(it)
    assert s.state_dict() == {"consumed_samples": 12}
    with pytest.raises(ConfigError, match=r"consumed_samples=6 is not a non-negative multiple of micro_batch_size × dp size = 4"):
        PretrainingSampler(micro_batch_size=2, dp_rank=0, dp_size=2, consumed_samples=6)


# --- the shipped providers -----------------------------------------------------------------------------------
def test_same_global_batches_for_any_dp_split_and_run_length(corpus, tmp_path):
    cfg = _cfg([corpus["a"]])
    ref = global_batches(cfg, tmp_path / "r", dp=1, mbs=4, iters=100)  # crosses into epoch 1 (~470 samples/epoch)
    ds = _provider(cfg, tmp_path / "r").splits["train"]
    assert 8 * 100 > ds.num_samples_per_epoch
    for i in (0, 1, 57, 99):  # global batch i = samples [8i, 8i + 8) of the dataset
        expected = collate([ds.sample(g) for g in range(8 * i, 8 * i + 8)], eod=256)
        assert all(torch.equal(ref[i][k], expected[k]) for k in KEYS)
    assert_batches_equal(global_batches(cfg, tmp_path / "r10", dp=1, mbs=4, iters=10), ref[:10])  # a 10-iteration run
    assert_batches_equal(global_batches(cfg, tmp_path / "d2", dp=2, mbs=2, iters=100), ref)
    assert_batches_equal(global_batches(cfg, tmp_path / "d2", dp=2, mbs=1, iters=100), ref)
    assert_batches_equal(global_batches(cfg, tmp_path / "d4", dp=4, mbs=2, iters=10), ref[:10])
    assert_batches_equal(global_batches(cfg, tmp_path / "r", dp=1, mbs=8, iters=10), ref[:10])


def test_resume_from_consumed_samples_continues_the_stream(corpus, tmp_path):
    cfg = _cfg([corpus["a"]])
    straight = global_batches(cfg, tmp_path, dp=2, mbs=2, iters=15)
    resumed = global_batches(cfg, tmp_path, dp=2, mbs=2, iters=10, consumed=5 * 8)
    assert_batches_equal(resumed, straight[5:])
    p = _provider(cfg, tmp_path, dp=2, r=1, mbs=2)
    it = p.train_iterator(16)
    for _ in range(3):
        next(it)
    assert p.state_dict() == {"consumed_samples": 16 + 3 * 4} and p.samples_read == 6
    with pytest.raises(ConfigError, match="consumed_samples=6 is not"):
        p.train_iterator(6)


def test_eval_iterator_restarts_and_needs_data_false(corpus, tmp_path):
    p = _provider(_cfg([corpus["a"]]), tmp_path)
    first = [next(p.eval_iterator("valid")) for _ in range(2)]
    assert all(torch.equal(first[0][k], first[1][k]) for k in KEYS)
    it = p.eval_iterator("test")
    a, b = next(it), next(it)
    assert not torch.equal(a["tokens"], b["tokens"]) and p.eval_samples_read == 8 and p.samples_read == 0  # 2 valid + 2 test micro-batches of 2
    idle = _provider(_cfg([corpus["a"]]), tmp_path, needs_data=False)
    it = idle.train_iterator(0)
    assert [next(it) for _ in range(3)] == [None, None, None] and idle.samples_read == 0


def test_provider_config_and_data_errors(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"train.global_batch_size=6 is not divisible by train.micro_batch_size × dp = 2 × 2"):
        _provider(_cfg([corpus["a"]]), tmp_path, dp=2, mbs=2, gbs=6)
    with pytest.raises(DataError, match=r"nope.idx: no such file"):
        _provider(_cfg([str(tmp_path / "nope")]), tmp_path)
    with pytest.raises(ConfigError, match=r"data.prefixes=\[0.5, 'x', 'y'\]: give \[prefix, ...\] or \[weight, prefix"):
        _provider(_cfg([0.5, "x", "y"]), tmp_path)
    with pytest.raises(ConfigError, match=r"data.prefixes is empty"):
        _provider(_cfg([]), tmp_path)
    from mptrain.data.provider import check_data_config  # the same line at start-up, before the run folder
    with pytest.raises(ConfigError, match=r"^data.prefixes is empty; set data.prefixes=\[PATH_PREFIX\]"):
        check_data_config(_cfg([]))
    check_data_config(DataConfig(name="mock", tokenizer=BYTE))  # mock data reads no corpus
    with pytest.raises(ConfigError, match=r"data.vocab_size=300 exceeds the tokenizer's vocab_size=257; set "
                                          r"data.vocab_size<=257$"):  # a byte tokenizer's size is no key
        build_provider(DataConfig(name="mock", vocab_size=300), tokenizer=ByteTokenizer(), seq_length=8, micro_batch_size=1,
                       global_batch_size=1, dp_rank=0, dp_size=1, needs_data=True)
    from mptrain.data.tokenizers import NullTokenizer

    with pytest.raises(ConfigError, match=r"set data.vocab_size<=100 or raise data.tokenizer.vocab_size$"):
        build_provider(DataConfig(name="mock", vocab_size=300), tokenizer=NullTokenizer(100), seq_length=8,
                       micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1, needs_data=True)
    p = _provider(DataConfig(_target_=INDEXED, name="indexed", prefixes=[corpus["a"]], split="1,0,0", tokenizer=BYTE), tmp_path)
    assert p.has_split("train") and not p.has_split("valid")
    with pytest.raises(DataError, match=r"data.split='1,0,0' leaves the valid split no documents"):
        p.eval_iterator("valid")


def test_data_shakespeare_from_hydra(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mptrain.config.schema import register
    from test_data import REPO

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["data=shakespeare", f"data.cache_dir={tmp_path}"])
    data = OmegaConf.to_object(cfg).data
    tok = build_tokenizer(data)
    assert isinstance(tok, ByteTokenizer)
    p = build_provider(data, tokenizer=tok, seq_length=SEQ, micro_batch_size=2, global_batch_size=4, dp_rank=0, dp_size=1, needs_data=True)
    assert [(s, p.splits[s].doc_begin, p.splits[s].doc_end) for s in ("train", "valid", "test")] == [
        ("train", 0, 38), ("valid", 38, 40), ("test", 40, 42)
    ]
    docs = shakespeare_docs()
    batch = next(p.eval_iterator("valid"))
    assert tok.decode(batch["tokens"][0].tolist()) == docs[38]["text"][:SEQ]  # troilus_and_cressida, in file order
    built = sorted(x.name for x in tmp_path.iterdir())
    assert built == ["index", "shakespeare-byte-2007947.bin", "shakespeare-byte-2007947.idx",
                     "shakespeare-byte-2007947.tokenizer.json"]


# --- collective construction on 2 gloo ranks -----------------------------------------------------------
def _dist_provider(rank, world_size, prefix, cache, fail, split="6,1,1", rank1_needs_data=True):
    from mptrain.groups import build_groups

    groups = build_groups(1, 1, None)
    try:
        cfg = _cfg([prefix + "-missing" if fail else prefix])
        cfg.split = split
        try:
            p = _provider(cfg, cache, dp=groups.dp_size, r=groups.dp_rank, mbs=2, needs_data=rank == 0 or rank1_needs_data)
        except DataError as exc:
            return f"DataError: {exc}"
        it = p.train_iterator(0)
        return {"tokens": [next(it) for _ in range(4)], "has_valid": p.has_split("valid"), "read": p.samples_read}
    finally:
        groups.destroy()


def test_collective_build_on_two_ranks(corpus, tmp_path):
    out = run_distributed(_dist_provider, 2, corpus["a"], str(tmp_path / "dist"), False)
    cfg = _cfg([corpus["a"]])
    for r in (0, 1):  # each rank reads what an in-process provider with its dp rank reads
        it = _provider(cfg, tmp_path / "local", dp=2, r=r, mbs=2).train_iterator(0)
        assert all(torch.equal(out[r]["tokens"][i]["tokens"], next(it)["tokens"]) for i in range(4))
        assert out[r]["has_valid"] is True and out[r]["read"] == 8
    assert (tmp_path / "dist" / "index").is_dir()
    # A rank that needs no data reads nothing but agrees with rank 0 about which splits exist.
    idle = run_distributed(_dist_provider, 2, corpus["a"], str(tmp_path / "dist"), False, "1,0,0", False)
    assert idle[1] == {"tokens": [None] * 4, "has_valid": False, "read": 0} and idle[0]["has_valid"] is False
    failed = run_distributed(_dist_provider, 2, corpus["a"], str(tmp_path / "dist"), True)
    assert failed[0].startswith("DataError: ") and "a-missing.idx: no such file" in failed[0]
    assert failed[1].startswith("DataError: rank 0 could not build the data: ") and "a-missing.idx: no such file" in failed[1]


def test_mock_sample_batch_equals_the_stacked_samples():
    ds = MockDataset(vocab_size=1000, seq_length=16, seed=7, split="valid")
    indices = [0, 5, 3, 2**40 + 3, 123456789]
    tokens, valid = read_samples(ds, indices)  # the vectorised read
    assert tokens.dtype == np.int64 and tokens.shape == (5, 17) and valid.all()
    assert np.array_equal(tokens, np.stack([ds.sample(i)[0] for i in indices]))
    per_sample = collate([ds.sample(i) for i in indices], eod=999)
    vectorised = collate_arrays(tokens, valid, eod=999)
    assert all(torch.equal(per_sample[k], vectorised[k]) for k in KEYS)


def test_indexed_and_blended_sample_batch_equal_the_stacked_samples(corpus, tmp_path):
    # epoch 0's EOD-padded last sample and samples of epochs 1 and 2 in one batch, indices in any order
    cfg = _cfg([corpus["a"]])
    ds = _provider(cfg, tmp_path / "r").splits["train"]
    n = ds.num_samples_per_epoch
    last = int(np.flatnonzero(np.asarray(ds.epoch_indices(0)[2]) == n - 1)[0])  # the stream's last sample
    indices = [last, n, 3, 2 * n + 5, 0, n - 2, n + last]
    tokens, valid = read_samples(ds, indices)
    assert not valid[0].all() and valid[1].all()  # the padded last sample is in the batch
    assert (tokens[:, :-1][valid[:, :-1]] == 256).any()  # and samples that cross into the next document
    assert np.array_equal(tokens, np.stack([ds.sample(i)[0] for i in indices]))
    assert np.array_equal(valid, np.stack([ds.sample(i)[1] for i in indices]))
    blend = BlendedDataset([ds, MockDataset(vocab_size=200, seq_length=ds.seq_length, seed=1, split="train")], [0.6, 0.4])
    tokens, valid = read_samples(blend, range(40))
    assert np.array_equal(tokens, np.stack([blend.sample(i)[0] for i in range(40)]))
    assert np.array_equal(valid, np.stack([blend.sample(i)[1] for i in range(40)]))


def test_split_shorter_than_one_sample_warns_once_per_split(corpus, tmp_path, capsys):
    cfg = dataclasses.replace(_cfg([corpus["a"]]), cache_dir=str(tmp_path))
    kw = dict(tokenizer=build_tokenizer(cfg), micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1,
              needs_data=True)
    build_provider(cfg, seq_length=SEQ, **kw)
    assert "warning" not in capsys.readouterr().err
    lengths = IndexedDataset(corpus["a"]).doc_lengths
    train_end = split_document_ranges("6,1,1", len(lengths))["train"][1]
    train_tokens = int(lengths[:train_end].sum())
    build_provider(cfg, seq_length=train_tokens, **kw)  # train: exactly seq_length tokens, one short of a sample
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"warning: data: the train split of {corpus['a']} has {train_tokens} tokens, fewer than one "
                      f"sample (model.seq_length + 1 = {train_tokens + 1}): its one sample is mostly padding; lower "
                      "model.seq_length, or give the split more documents (data.split)")
    assert [line.split(" split")[0] for line in err] == ["warning: data: the train", "warning: data: the valid",
                                                        "warning: data: the test"]
    build_provider(cfg, seq_length=train_tokens - 1, **kw)  # train holds one full sample: valid and test warn
    assert [line.split(" split")[0] for line in capsys.readouterr().err.splitlines()] == [
        "warning: data: the valid", "warning: data: the test"]
