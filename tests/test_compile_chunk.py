"""Issue 20's host-overhead paths, CPU side: the ``model.compile_scope`` / ``compile_mode`` rules, the
start-up line that says what is compiled, and the batch prefetch worker of CUDA ranks.

The compiled chunk's arithmetic (against eager, tp 1 and 2, with SP) is tests/test_bench_compile.py;
on CUDA, tests/test_gpu_compile_chunk.py (marker gpu).
"""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.errors import ConfigError
from mptrain.layers.gpt import check_model_config, chunk_compile_blocker, compile_mode_for
from mptrain.training.batch import BatchError, CheckedProvider
from mptrain.training.prefetch import PrefetchIterator
from mptrain.training.recorder import compile_note

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _groups(tp=1, pp=1):
    return SimpleNamespace(tp_size=tp, pp_size=pp)


@pytest.mark.parametrize("override, want", [
    ({}, None),
    ({"recompute_granularity": "selective"}, "model.recompute_granularity=selective"),
    ({"recompute_granularity": "full", "recompute_num_layers": 1}, "model.recompute_granularity=full"),
    ({"attention_dropout": 0.1}, "model.attention_dropout=0.1"),
    ({"hidden_dropout": 0.1}, None),  # drawn in the default generator outside SP: the chunk graph holds it
])
def test_chunk_compile_blocker(override, want):
    got = chunk_compile_blocker(ModelConfig(**override), sequence_parallel=False)
    assert (got is None) if want is None else got.startswith(want), got


def test_hidden_dropout_blocks_the_chunk_graph_under_sp_only():
    cfg = ModelConfig(hidden_dropout=0.1)
    assert chunk_compile_blocker(cfg, sequence_parallel=True).startswith("model.hidden_dropout=0.1 with sequence")
    assert chunk_compile_blocker(cfg, sequence_parallel=False) is None


@pytest.mark.parametrize("mode, device, tp, pp, chunk, want", [
    ("auto", CUDA, 1, 1, True, "reduce-overhead"),
    ("auto", CUDA, 1, 1, False, None),   # per-layer graphs: Inductor's default
    ("auto", CUDA, 2, 1, True, None),    # NCCL collectives in the graph
    ("auto", CUDA, 1, 2, True, None),    # 1F1B holds several micro-batches' outputs
    ("auto", CPU, 1, 1, True, None),
    (None, CUDA, 1, 1, True, None),
    ("max-autotune", CPU, 2, 2, True, "max-autotune"),
])
def test_compile_mode_for(mode, device, tp, pp, chunk, want):
    assert compile_mode_for(ModelConfig(compile_mode=mode), _groups(tp, pp), device, chunk) == want


@pytest.mark.parametrize("key, value", [("compile_scope", "graph"), ("compile_mode", "fast")])
def test_bad_compile_keys_are_one_line(key, value):
    with pytest.raises(ConfigError, match=rf"^model\.{key}: unknown option '{value}'; valid: .*; set model\.{key}"):
        check_model_config(dataclasses.replace(ModelConfig(), **{key: value}), ParallelConfig())


def _chunk(**kw):
    inner = SimpleNamespace(config=SimpleNamespace(compile_layers=kw.pop("compile_layers", True)), **kw)
    return SimpleNamespace(module=inner)  # a DDP-like wrapper: compile_note looks through .module


def test_compile_note_says_what_is_compiled():
    assert compile_note([_chunk(compile_layers=False, compiled_chunk=False)]) == ""
    assert compile_note([_chunk(compiled_chunk=True, compile_mode="reduce-overhead")]) == \
        " compile=chunk (one graph per model chunk, mode reduce-overhead)"
    assert compile_note([_chunk(compiled_chunk=True, compile_mode=None)] * 2) == \
        " compile=chunk (one graph per model chunk, mode default)"
    blocked = _chunk(compiled_chunk=False, compile_blocker="model.recompute_granularity=full (x)")
    assert compile_note([blocked]) == " compile=layer (chunk graph: model.recompute_granularity=full (x))"


# --- the prefetch worker --------------------------------------------------------------------------
def _batches(n, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"bad read {i}")
        yield {"tokens": torch.full((2, 4), i), "labels": torch.full((2, 4), i + 1)}


def test_prefetch_yields_the_same_batches_in_order():
    got = list(PrefetchIterator(_batches(7), depth=2, pin=False))
    assert [int(b["tokens"][0, 0]) for b in got] == list(range(7))
    assert all(torch.equal(b["labels"], torch.full((2, 4), i + 1)) for i, b in enumerate(got))


def test_prefetch_raises_the_readers_error_at_its_position_and_then_again():
    it = PrefetchIterator(_batches(5, fail_at=3), depth=2, pin=False)
    assert [int(next(it)["tokens"][0, 0]) for _ in range(3)] == [0, 1, 2]
    for _ in range(2):
        with pytest.raises(ValueError, match="bad read 3"):
            next(it)


def test_prefetch_end_is_stop_iteration_every_time():
    it = PrefetchIterator(_batches(1), pin=False)
    next(it)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)


def test_prefetch_reads_ahead_by_depth_only():
    read = []
    release = threading.Event()

    def source():
        for i in range(10):
            read.append(i)
            yield i
        release.set()

    it = PrefetchIterator(source(), depth=2, pin=False)
    assert next(it) == 0
    for _ in range(200):  # the worker fills the queue (2) and blocks holding the next item
        if len(read) >= 4:
            break
        threading.Event().wait(0.01)
    assert read == [0, 1, 2, 3]  # 0 handed out, 1-2 queued, 3 read and waiting for room
    assert list(it) == list(range(1, 10))


class _Provider:
    def __init__(self, bad_at=None):
        self.bad_at = bad_at

    def train_iterator(self, consumed_samples):
        for i in range(4):
            ids = torch.full((2, 8), 5 if i != self.bad_at else 999, dtype=torch.int64)
            yield {"tokens": ids, "labels": ids.clone(), "position_ids": torch.arange(8).repeat(2, 1),
                   "loss_mask": torch.ones(2, 8)}


@pytest.mark.parametrize("prefetch", [False, True])
def test_checked_provider_counts_at_hand_out_and_checks_ahead(prefetch):
    kw = dict(source="tests.Provider", micro_batch_size=2, seq_length=8, vocab_size=100, with_attention_mask=False,
              prefetch=prefetch)
    provider = CheckedProvider(_Provider(), **kw)
    it = provider.train_iterator(0)
    next(it)
    threading.Event().wait(0.05)  # let a worker read ahead: it must not count what it holds
    assert provider.samples_read == 2
    assert len(list(it)) == 3 and provider.samples_read == 8
    bad = CheckedProvider(_Provider(bad_at=1), **kw).train_iterator(0)
    next(bad)
    with pytest.raises(BatchError, match=r"tokens holds ids in \[999, 999\], expected ids in \[0, 100\)"):
        next(bad)
