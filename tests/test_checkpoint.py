"""Checkpoint save / load / resharding on hand-built model chunks + optimizer wrappers.

The state written is synthetic and layout-independent: every model param, fp32 main param and
Adam moment is this rank's shard (`take_shard`) of a full tensor drawn from (global key), so the
expected local value after loading under ANY layout is known exactly: a test fails on any
misplaced row, column, padded row or ZeRO-1 piece. Loads are exact (tolerance 0): values are
copied, never recomputed.
"""

from __future__ import annotations

import hashlib
import types
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from mptrain.checkpoint.reshard import flat_range_boxes
from mptrain.layers.sharding import take_shard

VOCAB = 100  # pads to 128 at tp1/tp2 (d=64) -> rank 1 of tp2 holds 36 real rows, 28 padded ones
BASE = ["model=tiny", "model.num_layers=4", "model.hidden_size=32", "model.seq_length=16",
        f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=64", "data.vocab_size=100"]


def _full(key: str, shape: tuple) -> torch.Tensor:
    """The layout-independent full tensor for a checkpoint key (deterministic in the key)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _build(rank, world, overrides, tp, pp, vpp=None, vocab_size=VOCAB):
    """(job, groups): ``job.state`` the `TrainState` of run.py's model chunks and optimizer wrapper, ``job.cfg``,
    ``job.scaler`` (the wrapper's loss scaler, or None)."""
    from train_utils import compose

    from mptrain.checkpoint import TrainState
    from mptrain.config.schema import as_config
    from mptrain.groups import build_groups
    from mptrain.training.run import build_model_and_optimizer

    cfg = as_config(compose(BASE + list(overrides)))
    groups = build_groups(tp, pp, vpp)
    chunks, optimizer, sched, tracker, scaler = build_model_and_optimizer(cfg, groups, None, vocab_size=vocab_size)
    state = TrainState(chunks=chunks, optimizer=optimizer, lr_scheduler=sched, rng_tracker=tracker)
    return types.SimpleNamespace(cfg=cfg, state=state, scaler=scaler), groups


def _expected(record, kind: str, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the synthetic full tensor ``kind`` ("model" | "main" | "exp_avg" | ...)."""
    full = _full(f"{kind}/{record.ckpt_name}", tuple(record.spec.global_shape))
    d = record.spec.partition_dim
    local = take_shard(full, record.spec, None if d is None else record.param.shape[d])
    return local


def _held(param, local_full: torch.Tensor) -> tuple:
    """(the tensor ``param`` stores here, the part of ``local_full`` (its whole TP shard) it holds): the param itself
    and all of it, or under ZeRO-2 / ZeRO-3 the local rows of the FSDP DTensor and those rows."""
    from mptrain.distributed.fsdp_optimizer import local_shard

    local, lo, hi = local_shard(param)
    return local, local_full.reshape(-1)[lo:hi].view(local.shape)


def _local_of(piece, local_full: torch.Tensor) -> torch.Tensor:
    """The part of a whole-shard tensor that a listed optimizer piece holds (a ZeRO-1 flat range or all of it)."""
    if piece.flat_range is not None:  # DistributedOptimizer: elements [lo, hi) of the flat shard
        lo, hi = piece.flat_range
        return local_full.reshape(-1)[lo:hi]
    return local_full


def _stepped(piece) -> torch.Tensor:
    return piece.main if piece.main is not None else piece.param


def _fill_synthetic(job) -> None:
    from mptrain.checkpoint.state import optimizer_pieces, param_records

    records = param_records(job.state.chunks)
    with torch.no_grad():
        for r in records:
            local, want = _held(r.param, _expected(r, "main", r.param))
            local.copy_(want.to(local.dtype))
        opt = job.state.optimizer
        for r, e in optimizer_pieces(opt.sharded_state_dict(), records):
            _stepped(e).copy_(_local_of(e, _expected(r, "main", r.param)))
            opt.optimizer.state[_stepped(e)] = {
                "step": torch.tensor(3.0),
                "exp_avg": _local_of(e, _expected(r, "exp_avg", r.param)).clone(),
                "exp_avg_sq": _local_of(e, _expected(r, "exp_avg_sq", r.param)).abs().clone(),
            }
    job.state.lr_scheduler.num_steps = 5
    if job.scaler is not None:
        job.scaler.load_state_dict({"scale": 1024.0, "growth_tracker": 7, "hysteresis_tracker": 1})


def _check_synthetic(job, expect_scale) -> dict:
    """Compare everything loaded with the synthetic expectation; returns counts for the caller."""
    from mptrain.checkpoint.state import optimizer_pieces, param_records

    records = param_records(job.state.chunks)
    n = 0
    for r in records:
        local, want = _held(r.param, _expected(r, "main", r.param))
        assert torch.equal(local, want.to(local.dtype)), f"model param {r.name} (ckpt {r.ckpt_name})"
        n += 1
    opt = job.state.optimizer
    listed = opt.sharded_state_dict()
    for r, e in optimizer_pieces(listed, records):
        assert torch.equal(_stepped(e).data, _local_of(e, _expected(r, "main", r.param))), f"main {r.name}"
        st = e.state
        assert float(st["step"]) == 3.0
        assert torch.equal(st["exp_avg"], _local_of(e, _expected(r, "exp_avg", r.param))), f"exp_avg {r.name}"
        assert torch.equal(st["exp_avg_sq"], _local_of(e, _expected(r, "exp_avg_sq", r.param)).abs()), r.name
    assert job.state.lr_scheduler.num_steps == 5
    if job.scaler is not None:  # the saved scale, or the initial one when the checkpoint had no scaler
        assert float(job.scaler.scale.item()) == expect_scale
    return {"params": n, "entries": len(list(optimizer_pieces(listed, records)))}


def _save_task(rank, world, root, overrides, tp, pp, vpp=None):
    from mptrain.checkpoint import save_checkpoint

    job, groups = _build(rank, world, overrides + [f"checkpoint.save={root}"], tp, pp, vpp)
    try:
        _fill_synthetic(job)
        job.state.iteration, job.state.consumed_samples = 6, 48
        folder = save_checkpoint(job.state, cfg=job.cfg, groups=groups)
        assert folder == Path(root) / "iter_0000006"
    finally:
        groups.destroy()


class _Log:
    def __init__(self):
        self.lines = []

    def log(self, msg, *, console=True):
        self.lines.append(msg)


def _load_task(rank, world, root, overrides, tp, pp, vpp=None, *, expect_scale=1024.0):
    from mptrain.checkpoint import maybe_load_checkpoint

    job, groups = _build(rank, world, overrides + [f"checkpoint.load={root}"], tp, pp, vpp)
    try:
        log = _Log()
        maybe_load_checkpoint(job.state, cfg=job.cfg, groups=groups, log=log.log)
        state = {"iteration": job.state.iteration, "consumed_samples": job.state.consumed_samples}
        counts = _check_synthetic(job, expect_scale)
        return state, counts, log.lines
    finally:
        groups.destroy()


# --- pure box math --------------------------------------------------------------------------------
def test_flat_range_boxes_table():
    assert flat_range_boxes((3, 4), 2, 11) == [(2, (0, 2), (1, 2)), (4, (1, 0), (1, 4)), (8, (2, 0), (1, 3))]
    assert flat_range_boxes((3, 4), 4, 12) == [(4, (1, 0), (2, 4))]
    assert flat_range_boxes((3, 4), 5, 7) == [(5, (1, 1), (1, 2))]
    assert flat_range_boxes((10,), 3, 7) == [(3, (3,), (4,))]
    assert flat_range_boxes((2, 3, 4), 5, 17) == [(5, (0, 1, 1), (1, 1, 3)), (8, (0, 2, 0), (1, 1, 4)),
                                                   (12, (1, 0, 0), (1, 1, 4)), (16, (1, 1, 0), (1, 1, 1))]
    assert flat_range_boxes((3, 4), 6, 6) == []
    with pytest.raises(ValueError):
        flat_range_boxes((3, 4), 0, 13)


def test_flat_range_boxes_tile_every_range():
    """Every [lo, hi) of a [5, 3, 4] tensor: boxes are contiguous in flat order and cover exactly [lo, hi)."""
    shape = (5, 3, 4)
    ref = torch.arange(60).view(shape)
    for lo in range(0, 61, 7):
        for hi in range(lo, 61, 5):
            got = []
            for start, offsets, sizes in flat_range_boxes(shape, lo, hi):
                box = ref[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert box.reshape(-1).tolist() == list(range(start, start + box.numel()))
                got += box.reshape(-1).tolist()
            assert got == list(range(lo, hi))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist=True: one process on purpose
def test_load_planner_fills_every_destination_of_one_box(tmp_path):
    """Several local destinations of one saved box are all filled (regression: the full-suite failures
    of ``zero1-fp32 -> tp1pp1-fp16 / tp1pp2vpp2-dp2-zero1`` came from a load planner that named its
    destinations by (key, offsets), so the last chunk with those offsets swallowed the others' reads).

    One process, no process group: ``model/w`` [6, 4] is saved as two row boxes; the load asks for
    the same key three times, like a tp1 fp16 run (fp16 param + fp32 main param, both the whole
    tensor at offsets (0, 0)) plus a ZeRO-1 piece that also starts at (0, 0) but is smaller.
    """
    from mptrain.checkpoint.dcp_io import load_chunks, save_chunks
    from mptrain.checkpoint.reshard import Chunk

    full = _full("model/w", (6, 4))
    saved = [Chunk("model/w", (6, 4), (0, 0), full[:3]), Chunk("model/w", (6, 4), (3, 0), full[3:])]
    save_chunks(str(tmp_path), saved, {"common": {"iteration": 1}}, no_dist=True)
    half = torch.zeros(6, 4, dtype=torch.float16)
    main = torch.zeros(6, 4)
    piece = torch.zeros(2, 4)  # rows [0, 2): a ZeRO-1 flat piece [0, 8) of the same tensor
    wanted = [Chunk("model/w", (6, 4), (0, 0), t) for t in (half, main, piece)]
    objects = load_chunks(str(tmp_path), wanted, ["common"], no_dist=True)
    assert objects == {"common": {"iteration": 1}}
    # exact (tolerance 0): loading copies; the fp16 destination gets fp32 -> fp16 rounding, as .to() does
    assert torch.equal(half, full.to(torch.float16))
    assert torch.equal(main, full)
    assert torch.equal(piece, full[:2])


# --- resharding -----------------------------------------------------------------------------------
OTHER_ARCH = ["model.activation=swiglu", "model.normalization=RMSNorm", "model.num_query_groups=2",
              "model.untie_embeddings_and_output_weights=true"]
SAVE_LAYOUTS = {
    "tp2pp2-fp16": (4, ["parallel=tp2pp2", "precision=fp16"], 2, 2),
    "tp2pp1-dp2-zero1-fp32": (4, ["parallel=tp2pp1", "parallel.use_distributed_optimizer=true"], 2, 1),
    # SwiGLU fc1 is [gate; up] with ShardSpec.interleave=2 (two boxes per shard); GQA; untied output layer
    "tp2pp1-dp2-zero1-swiglu": (4, ["parallel=tp2pp1", "parallel.use_distributed_optimizer=true", *OTHER_ARCH], 2, 1),
    # ZeRO-3: each rank holds rows of its TP shard (FSDP DTensors), its fp32 shards are the master weights
    "tp2pp1-dp2-zero3-fp16": (4, ["parallel=tp2pp1", "parallel.data_parallel_sharding_strategy=optim_grads_params",
                                  "precision=fp16"], 2, 1),
}
LOAD_LAYOUTS = {
    "tp1pp1-fp32": (1, ["parallel=tp1pp1"], 1, 1),
    "tp1pp1-fp16": (1, ["parallel=tp1pp1", "precision=fp16"], 1, 1),
    "tp1pp2-fp16": (2, ["parallel=tp1pp2", "precision=fp16"], 1, 2),
    "tp2pp1-dp2-zero1-fp16": (4, ["parallel=tp2pp1", "parallel.use_distributed_optimizer=true", "precision=fp16"], 2, 1),
    "tp1pp2vpp2-dp2-zero1": (4, ["parallel=tp1pp2vpp2", "parallel.use_distributed_optimizer=true"], 1, 2, 2),
    "tp2pp2-fp16-same": (4, ["parallel=tp2pp2", "precision=fp16"], 2, 2),
    "tp1pp2-swiglu-bf16": (2, ["parallel=tp1pp2", "precision=bf16", *OTHER_ARCH], 1, 2),
    "tp1pp2-dp2-zero2-bf16": (4, ["parallel=tp1pp2", "parallel.data_parallel_sharding_strategy=optim_grads",
                                  "precision=bf16"], 1, 2),
}
PAIRS = [("tp2pp2-fp16", "tp1pp1-fp32"), ("tp2pp2-fp16", "tp1pp2-fp16"), ("tp2pp2-fp16", "tp2pp1-dp2-zero1-fp16"),
         ("tp2pp2-fp16", "tp2pp2-fp16-same"), ("tp2pp1-dp2-zero1-fp32", "tp1pp1-fp16"),
         ("tp2pp1-dp2-zero1-fp32", "tp1pp2vpp2-dp2-zero1"), ("tp2pp1-dp2-zero1-swiglu", "tp1pp2-swiglu-bf16"),
         # ZeRO-3 -> DDP on another layout, DDP -> ZeRO-2, ZeRO-3 -> ZeRO-2 on another layout
         ("tp2pp1-dp2-zero3-fp16", "tp1pp1-fp16"), ("tp2pp2-fp16", "tp1pp2-dp2-zero2-bf16"),
         ("tp2pp1-dp2-zero3-fp16", "tp1pp2-dp2-zero2-bf16")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(src)`` -> the folder holding the checkpoint `_save_task` wrote under SAVE_LAYOUTS[src], saved once per
    module (suite time: several pairs load the same source; loading only reads the folder)."""
    done = {}

    def get(src):
        if src not in done:
            root = tmp_path_factory.mktemp(src)
            world, overrides, tp, pp, *vpp = SAVE_LAYOUTS[src]
            run_distributed(_save_task, world, str(root), overrides, tp, pp, *vpp)
            done[src] = root
        return done[src]

    return get


@pytest.mark.parametrize("src,dst", PAIRS)
def test_reshard_exact(saved, src, dst):
    """Save under one layout, load under another: every local tensor is exactly the right shard."""
    tmp_path = saved(src)
    assert (tmp_path / "latest").read_text().strip() == "6"
    world, overrides, tp, pp, *vpp = LOAD_LAYOUTS[dst]
    expect_scale = 1024.0 if "precision=fp16" in SAVE_LAYOUTS[src][1] else 2.0**32  # fp32 saves no scaler
    results = run_distributed(_load_task, world, str(tmp_path), overrides, tp, pp, *vpp, expect_scale=expect_scale)
    for state, counts, _lines in results:
        assert state == {"iteration": 6, "consumed_samples": 48}
        assert counts["params"] > 0 and counts["entries"] > 0
    lines = results[0][2]
    same_layout = dst.endswith("-same")
    assert any("re-derived" in line for line in lines) != same_layout, lines


def _mismatch_task(rank, world, root, overrides=("model.num_layers=2", "model.hidden_size=16"), vocab_size=VOCAB):
    from mptrain.checkpoint import maybe_load_checkpoint
    from mptrain.errors import ConfigError

    job, groups = _build(rank, world, [f"checkpoint.load={root}", *overrides], 1, 1, vocab_size=vocab_size)
    try:
        with pytest.raises(ConfigError) as info:
            maybe_load_checkpoint(job.state, cfg=job.cfg, groups=groups)
        assert info.value.symmetric  # the same line on every rank (gathered names): rank 0 alone prints it
        return str(info.value)
    finally:
        groups.destroy()


def test_different_model_is_a_config_error(tmp_path):
    run_distributed(_save_task, 2, str(tmp_path), ["parallel=tp1pp2"], 1, 2)
    msg = run_distributed(_mismatch_task, 1, str(tmp_path))[0]
    assert msg.startswith(f"checkpoint.load: {tmp_path}/iter_0000006 holds a different model: model.num_layers=4 "
                          "in the checkpoint vs 2, model.hidden_size=32 in the checkpoint vs 16; shape mismatch: ")
    assert msg.count(" (checkpoint [") == 3 and "more); " in msg  # three names show the kind; the keys say why
    assert "decoder.layers.0.self_attention" in msg or "decoder.layers.0." in msg
    assert "not in the model: decoder.layers.2." in msg  # layers 2, 3 exist only in the checkpoint
    assert "vocabulary" not in msg and "model.max_position_embeddings=" not in msg  # not a row-only mismatch
    # another tokenizer's vocabulary (257 rows) and a shorter seq_length: each mismatch names its fix
    msg = run_distributed(_mismatch_task, 1, str(tmp_path), ("model.seq_length=8",), vocab_size=257)[0]
    assert "embedding.word_embeddings.weight (checkpoint [100, 32], model [257, 32])" in msg
    assert "embedding.position_embeddings.weight (checkpoint [16, 32], model [8, 32])" in msg
    assert ("; the vocabulary (rows of the word embedding and output layer) follows data.tokenizer (or model.vocab_size, "
            "padded to model.make_vocab_size_divisible_by): use the checkpoint's tokenizer "
            "(checkpoint.use_checkpoint_args=true, or the same data.tokenizer); ") in msg
    assert ("; the position embedding has model.max_position_embeddings rows (null = model.seq_length): set "
            "model.max_position_embeddings=16 (the checkpoint's) to load it at another model.seq_length; ") in msg
    assert "\n" not in msg


def test_use_checkpoint_args_keeps_the_position_table_of_another_seq_length():
    """The fixture saved a learned-position model with max_position_embeddings null at seq_length 16: its table has
    16 rows, which use_checkpoint_args carries to a run of seq_length 8 (the run's seq_length stays its own)."""
    from mptrain.checkpoint.args import apply_checkpoint_args
    from mptrain.config.schema import as_config
    from train_utils import compose

    ckpt = Path(__file__).parent / "fixtures" / "ckpt_fp16_tp1pp2" / "checkpoint"
    overrides = [f"checkpoint.load={ckpt}", "checkpoint.use_checkpoint_args=true", "model.seq_length=8"]
    cfg = apply_checkpoint_args(as_config(compose(overrides)), overrides)
    assert (cfg.model.max_position_embeddings, cfg.model.seq_length) == (16, 8)


# --- folders, latest, keep_last_n (pure file logic) --------------------------------------------------
def _fake_save(root, iteration, keep_last_n=None):
    """What save_checkpoint does on disk, with stand-in files for DCP's output."""
    from mptrain.checkpoint import atomic

    tmp = atomic.prepare_tmp(str(root), iteration)
    (tmp / ".metadata").write_bytes(b"x")
    atomic.write_json(tmp / atomic.META_FILE, {"iteration": iteration})
    return atomic.publish(str(root), iteration, keep_last_n)


def test_load_refusal_names_the_folder_a_resume_reads(tmp_path):
    """checkpoint.load where a resume would load nothing and train a fresh run (one iteration's folder, its
    `latest` file, the run folder above the checkpoints, an empty folder that is not the save folder) or a
    missing load_iteration: refused at start-up, before the run folder is written."""
    from mptrain.checkpoint import atomic
    from mptrain.errors import ConfigError
    from mptrain.training.run import _validated
    from train_utils import compose

    ck = tmp_path / "a" / "checkpoints"
    _fake_save(ck, 4)
    assert atomic.load_refusal(str(ck), None) is None and atomic.load_refusal(str(ck), 4) is None
    line = (f"checkpoint.load={ck}/iter_0000004 is the checkpoint of one iteration, not a checkpoint folder; "
            f"load it as checkpoint.load={ck} checkpoint.load_iteration=4")
    assert atomic.load_refusal(str(ck / "iter_0000004"), None) == line
    assert atomic.load_refusal(str(ck), 5) == (f"checkpoint.load_iteration=5: {ck}/iter_0000005 is not a "
                                               f"complete checkpoint (complete iterations in {ck}: [4])")
    assert atomic.load_refusal(str(ck / "latest"), None) == (
        f"checkpoint.load={ck}/latest is a file; point it at the folder that holds the iter_* folders and latest "
        f"(checkpoint.load={ck})")
    assert atomic.load_refusal(str(tmp_path / "a"), None) == (
        f"checkpoint.load={tmp_path / 'a'} holds no complete checkpoint; point it at checkpoint.load={ck}, or at "
        "this run's checkpoint.save folder to resume when it holds one and start fresh otherwise")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert atomic.load_refusal(str(empty), None, str(empty)) is None  # a restartable job's first start: fresh
    assert atomic.load_refusal(str(tmp_path / "missing"), None, str(tmp_path / "missing")) is None  # likewise
    assert atomic.load_refusal(str(tmp_path / "missing"), None) == (
        f"checkpoint.load={tmp_path / 'missing'} does not exist; fix the path, or set checkpoint.load to the "
        "checkpoint.save folder to resume when it exists and start fresh otherwise")
    assert atomic.load_refusal(str(empty), None).startswith(f"checkpoint.load={empty} holds no complete checkpoint; "
                                                             "point it at a checkpoint.save folder")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        _validated(compose(["model=tiny", f"run.dir={run_dir}", f"checkpoint.load={ck}/iter_0000004"]), 1)
    assert str(info.value) == line and not run_dir.exists()


def test_save_refusal_before_the_first_step(tmp_path, monkeypatch):
    """checkpoint.save that no save could write is refused at start-up, before any step or file."""
    from mptrain.checkpoint import atomic
    from mptrain.errors import ConfigError
    from mptrain.training.run import _validated
    from train_utils import compose

    (tmp_path / "afile").write_text("x")
    assert atomic.save_refusal(str(tmp_path / "new" / "deep" / "ck")) is None  # the save creates the folders
    assert atomic.save_refusal(str(tmp_path / "afile")) == (
        f"checkpoint.save={tmp_path}/afile is a file, not a folder; pick another checkpoint.save")
    line = (f"checkpoint.save={tmp_path}/afile/ck: {tmp_path}/afile is a file, not a folder; pick another "
            "checkpoint.save")
    assert atomic.save_refusal(str(tmp_path / "afile" / "ck")) == line
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        _validated(compose(["model=tiny", f"run.dir={run_dir}", f"checkpoint.save={tmp_path}/afile/ck"]), 1)
    assert str(info.value) == line and not run_dir.exists()
    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)  # as a user without write permission there
    assert atomic.save_refusal(str(tmp_path / "new" / "ck")) == (
        f"checkpoint.save={tmp_path}/new/ck: {tmp_path} is not writable by this user; fix its permissions or point "
        "checkpoint.save= elsewhere")


def test_keep_last_n_and_latest(tmp_path):
    from mptrain.checkpoint import atomic

    assert [_fake_save(tmp_path, it, keep_last_n=2) for it in (2, 4, 6, 8)] == [[], [], [2], [4]]
    assert atomic.list_iterations(str(tmp_path)) == [6, 8]
    assert (tmp_path / "latest").read_text() == "8\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000006", "iter_0000008", "latest"]
    _fake_save(tmp_path, 6, keep_last_n=2)  # re-saving an existing iteration (a resumed run) replaces it
    assert (tmp_path / "latest").read_text() == "6\n" and atomic.list_iterations(str(tmp_path)) == [6, 8]
    assert not (tmp_path / "iter_0000006.old").exists()
    # a resume rewound to 6 saves 7: keep_last_n counts 6 and 7; 8 (the rewound run's) stays until passed
    assert _fake_save(tmp_path, 7, keep_last_n=2) == [] and atomic.list_iterations(str(tmp_path)) == [6, 7, 8]
    assert _fake_save(tmp_path, 8, keep_last_n=2) == [6] and atomic.list_iterations(str(tmp_path)) == [7, 8]
    assert (tmp_path / "latest").read_text() == "8\n"


def test_resolve_load_dir(tmp_path):
    from mptrain.checkpoint import atomic

    assert atomic.resolve_load_dir(str(tmp_path / "none")) == (None, None)
    _fake_save(tmp_path, 4)
    _fake_save(tmp_path, 8)
    assert atomic.resolve_load_dir(str(tmp_path)) == (tmp_path / "iter_0000008", None)
    assert atomic.resolve_load_dir(str(tmp_path), 4) == (tmp_path / "iter_0000004", None)
    with pytest.raises(FileNotFoundError) as info:
        atomic.resolve_load_dir(str(tmp_path), 5)
    assert str(info.value) == (f"checkpoint.load_iteration=5: {tmp_path}/iter_0000005 is not a complete checkpoint "
                               f"(complete iterations in {tmp_path}: [4, 8])")
    (tmp_path / "iter_0000008" / ".metadata").unlink()  # latest names a broken folder: fall back, and say so
    folder, note = atomic.resolve_load_dir(str(tmp_path))
    assert folder == tmp_path / "iter_0000004"
    assert note == f"checkpoint: {tmp_path}/latest names iteration 8, which is not complete; loading iteration 4"


def test_zero3_checkpoint_holds_what_ddp_writes(saved):
    """A ZeRO-3 fp16 checkpoint (fp32 FSDP shards in memory) holds the keys and dtypes a DDP fp16 one holds: model/ in
    fp16, main/ and the moments in fp32 (exports and other layouts read it alike)."""
    from torch.distributed.checkpoint import FileSystemReader

    def tensors(src):
        md = FileSystemReader(str(saved(src) / "iter_0000006")).read_metadata().state_dict_metadata
        return {k: v.properties.dtype for k, v in md.items() if hasattr(v, "properties")}

    zero3, ddp = tensors("tp2pp1-dp2-zero3-fp16"), tensors("tp2pp2-fp16")
    assert zero3 == ddp
    assert {d for k, d in ddp.items() if k.startswith("model/")} == {torch.float16}
    assert {d for k, d in ddp.items() if k.startswith("main/")} == {torch.float32}
