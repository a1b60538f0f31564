"""Checkpoints already on disk keep loading: the fixtures under tests/fixtures/ were written by the
``mptrain-dcp-1`` writer of an earlier release, on another CPU, together with the metrics of the
uninterrupted run.

Each fixture holds the checkpoint of iteration 4 of an 8-iteration run and ``straight.json``: the
train rows (``lm_loss``, ``grad_norm``, ``loss_scale``, ``lr``, ``skipped_iter``) of the same 8
iterations run straight through on the writer's CPU.

- ``ckpt_fp16_tp1pp2``: fp16 params with fp32 main params, a dynamic loss scaler whose scale grows
  every 2 clean steps (its trackers must cross the checkpoint), pipeline-parallel over 2 processes;
- ``ckpt_bf16_dp2_zero1``: bf16 with the distributed optimizer over 2 DP ranks (main params and
  Adam moments saved as flat ZeRO-1 pieces).

One job per fixture resumes from it (`_resume`): right after the load it records what every rank
holds and re-saves it with today's writer, then trains iterations 5..8; a second job resumes from
that re-save. What is compared, and how exactly:

1. the state after the load (weights, fp32 main params, optimizer state, loss scaler with its
   trackers, skip counters, LR scheduler, RNG, iteration and consumed samples) equals the
   fixture's saved tensors and objects bitwise: the same bytes read back;
2. the two continuations (from the fixture, from today's re-save) are equal bitwise (rows and the
   checkpoint of iteration 8): both computed on this machine;
3. the continuation equals the recorded rows within `TOLERANCES`: those were computed on another
   CPU, whose kernels round differently (floating-point results are bitwise only on one machine).

``python tests/test_checkpoint_compat.py --write`` rewrites them: only ever with a release whose
checkpoints must keep loading.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from harness import run_distributed
from train_utils import read_rows, run_job, without_timing

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=16", "model.num_attention_heads=2",
         "model.seq_length=16", "model.vocab_size=64", "model.make_vocab_size_divisible_by=16", "data.vocab_size=64",
         "train.eval_interval=null", "train.global_batch_size=8", "train.micro_batch_size=2", "train.train_iters=8"]
CASES = {
    "ckpt_fp16_tp1pp2": (2, ["parallel=tp1pp2", "precision=fp16", "loss_scaler.initial_scale=65536",
                              "loss_scaler.growth_interval=2"]),
    "ckpt_bf16_dp2_zero1": (2, ["parallel=tp1pp1", "precision=bf16", "optim=adamw",
                                 "parallel.use_distributed_optimizer=true"]),
}
KEYS = ("lm_loss", "grad_norm", "loss_scale", "lr", "skipped_iter")
# The recorded rows' floats that another CPU rounds differently, with their relative tolerance (loss_scale, lr and
# skipped_iter are decisions and the schedule's arithmetic: equal everywhere). Why not bitwise: other vector kernels
# (AVX-512 / AVX2 / scalar, another matmul blocking) sum in another order, so an fp32 sum moves by a few units of
# 2^-24 and a 16-bit tensor written from it can round one unit the other way (fp16 2^-11 = 4.9e-4, bf16 2^-8 =
# 3.9e-3 per element); the 16-bit training step carries such flips on. Measured against these rows over
# iterations 5..8: a CI machine's fp16 lm_loss 8.7e-8 and grad_norm 1.6e-5 off at the first step; an AVX2 CPU
# with scalar kernels (ATEN_CPU_CAPABILITY=default): lm_loss <= 7.3e-7 / grad_norm <= 6.3e-5 (fp16), lm_loss <=
# 7.4e-6 / grad_norm <= 6.2e-4 (bf16); an AVX-512 CPU: bf16 grad_norm 3.9e-4 at iteration 8, fp16 bitwise. The
# bounds are 7-16x the largest of those. A wrong state
# moves them further: resuming without the optimizer state moves lm_loss by 5.3e-4 .. 1.6e-3 and grad_norm by
# 1.9e-3 .. 7.7e-2 from iteration 6 on (10x or more above the lm_loss bounds: lm_loss is the sharp check), a
# fresh loss scaler changes loss_scale; what no row can show (the RNG with dropout 0) test 1 compares bitwise.
TOLERANCES = {"ckpt_fp16_tp1pp2": {"lm_loss": 1e-5, "grad_norm": 1e-3},
              "ckpt_bf16_dp2_zero1": {"lm_loss": 5e-5, "grad_norm": 1e-2}}
SAVED_AT = 4
ITERS = list(range(SAVED_AT + 1, 9))


def _rows(run_dir) -> dict:
    return {r["iteration"]: {k: r[k] for k in KEYS} for r in read_rows(run_dir)}


# --- the jobs ---------------------------------------------------------------------------------------


def _state_after_load(built, at) -> dict:
    """This rank's state as the load left it, keyed like the checkpoint (tensors cloned to the CPU)."""
    from mptrain.checkpoint.rng import capture, rng_key
    from mptrain.checkpoint.state import param_records

    records = param_records(built.chunks)
    names = {id(r.param): r.ckpt_name for r in records}
    wrapper = built.trainer.optimizer.sharded_state_dict()
    pieces = []
    for piece in wrapper.params:
        state = {k: (v.detach().cpu().clone() if hasattr(v, "detach") else v) for k, v in piece.state.items()}
        main = piece.main.detach().cpu().clone() if piece.main is not None else None
        pieces.append({"name": names[id(piece.param)], "main": main, "state": state, "flat_range": piece.flat_range})
    return {
        "iteration": at.iteration,
        "consumed_samples": at.consumed_samples,
        "params": [(r.ckpt_name, r.param.detach().cpu().clone()) for r in records],
        "pieces": pieces,
        "scaler": wrapper.scaler,
        "counters": wrapper.counters,
        "lr_scheduler": built.trainer.lr_scheduler.state_dict(),
        "rng_key": rng_key(built.groups),
        "rng": capture(built.rng_tracker),
    }


def _resume_recording_the_load(rank: int, world: int, overrides: list) -> bytes:
    """Pool task: `run_job` whose checkpoint load is followed at once by a record of this rank's state
    (`_state_after_load`) and a save of it (``checkpoint.save``, today's writer), before iteration 5.
    Returns the record, `torch.save`d (picklable through the pool's queues)."""
    import torch

    from mptrain.training.checkpointing import Checkpointer

    load = Checkpointer.resume
    record = {}

    def resume_record_and_save(self):
        at = load(self)
        record.update(_state_after_load(self.built, at))
        self.save(at)
        return at

    Checkpointer.resume = resume_record_and_save
    try:
        run_job(rank, world, overrides)
    finally:
        Checkpointer.resume = load  # the pool's worker runs other tests next
    buf = io.BytesIO()
    torch.save(record, buf)
    return buf.getvalue()


@pytest.fixture(scope="module", params=sorted(CASES))
def resumed(request, tmp_path_factory) -> dict:
    """Per fixture: the job resumed from it (its run folder, its per-rank record of the state after the load,
    today's re-save of that state and its checkpoint of iteration 8) and the job resumed from the re-save."""
    import torch

    case = request.param
    world, extra = CASES[case]
    tmp = tmp_path_factory.mktemp(case)
    fixture = tmp / "fixture"
    shutil.copytree(FIXTURES / case / "checkpoint", fixture)  # loading must not depend on writing into the fixture
    first, again = tmp / "from_fixture", tmp / "from_resave"
    records = run_distributed(_resume_recording_the_load, world, SMALL + extra + [
        f"run.dir={first}", f"checkpoint.load={fixture}", f"checkpoint.save={first}/ckpt"])
    run_distributed(run_job, world, SMALL + extra + [
        f"run.dir={again}", f"checkpoint.load={first}/ckpt", f"checkpoint.load_iteration={SAVED_AT}",
        f"checkpoint.save={again}/ckpt"])
    return {"case": case, "fixture": fixture, "first": first, "again": again,
            "records": [torch.load(io.BytesIO(b), weights_only=False) for b in records]}


# --- reading and comparing ----------------------------------------------------------------------------


def _read(folder) -> tuple[dict, dict]:
    """({key: full tensor}, {key: object}) of every entry of a checkpoint folder, read in this process with the
    project's DCP reader (no process group)."""
    import torch

    from mptrain.checkpoint import dcp_io
    from mptrain.checkpoint.reshard import Chunk

    metadata = dcp_io.read_metadata(str(folder))
    tensors = {key: torch.empty(shape, dtype=dcp_io.tensor_dtype(metadata, key))
               for key, (shape, _) in dcp_io.tensor_keys(metadata).items()}
    chunks = [Chunk(key, tuple(t.shape), (0,) * t.dim(), t) for key, t in tensors.items()]
    objects = dcp_io.load_chunks(str(folder), chunks, dcp_io.object_keys(metadata), no_dist=True)
    return tensors, objects


def _assert_same(got, want, where: str) -> None:
    """``got`` equals ``want`` bitwise: tensors and arrays by dtype, shape and bytes; containers item by item."""
    import torch

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), where
        bits = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (got, want)]
        assert torch.equal(*bits), f"{where}: max |diff| {(got.double() - want.double()).abs().max().item()}"
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, where
        assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), (where, sorted(got, key=str))
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


SCHEDULE_KEYS_ADDED = {"lr_warmup_fraction": None, "lr_warmup_samples": 0, "lr_decay_samples": None,
                       "samples_per_step": 1, "samples_per_unit": 1, "decoupled_lr": None, "decoupled_min_lr": None}
"""LR schedule state keys added since the fixtures were written (sample-based schedules, the warm-up fraction, the
embedding and output layer's decoupled LR, a step batch-size schedule's iteration unit), at their values in an
iteration-based run without a warm-up fraction, a decoupled LR or a step schedule: the fixtures' configs."""


def _assert_schedule(got: dict, want: dict, where: str) -> None:
    """An LR schedule's state: the fixture's keys bitwise, and the keys added since at their off values."""
    assert {k: v for k, v in got.items() if k not in want} == SCHEDULE_KEYS_ADDED, where
    _assert_same({k: got[k] for k in want}, want, where)


def _assert_piece(got, full, flat_range, covered: dict, key: str, where: str) -> None:
    """``got`` is the whole of ``full`` (flat_range None) or elements [lo, hi) of it flattened (a ZeRO-1 piece),
    bitwise; marks the elements compared in ``covered[key]``."""
    import torch

    lo, hi = flat_range if flat_range is not None else (0, full.numel())
    want = full.reshape(-1)[lo:hi] if flat_range is not None else full
    _assert_same(got, want, f"{where}: {key}")
    covered.setdefault(key, torch.zeros(full.numel(), dtype=torch.bool))[lo:hi] = True


def _common_without_paths(common: dict) -> dict:
    # the config holds the run's folders (run.dir, checkpoint.load / save), which differ between two runs
    return {k: v for k, v in common.items() if k != "config"}


# --- 1. the state after the load -----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the fixture is read in this one process
def test_the_loaded_state_is_the_fixtures_bitwise(resumed):
    """Every rank holds after the load exactly what the earlier release saved; every saved tensor element is held."""
    import torch

    tensors, objects = _read(resumed["fixture"] / f"iter_{SAVED_AT:07d}")
    common = objects["common"]
    covered: dict = {}
    for rank, rec in enumerate(resumed["records"]):
        where = f"rank {rank}"
        assert (rec["iteration"], rec["consumed_samples"]) == (common["iteration"], common["consumed_samples"])
        assert (rec["iteration"], rec["consumed_samples"]) == (SAVED_AT, SAVED_AT * 8)
        for name, param in rec["params"]:  # a half param holds model/ (its main param is checked below)
            key = f"main/{name}" if param.dtype == torch.float32 and f"main/{name}" in tensors else f"model/{name}"
            _assert_piece(param, tensors[key], None, covered, key, where)
        for piece in rec["pieces"]:
            name = piece["name"]
            assert piece["main"] is not None, (where, name)  # fp16 / bf16 params step fp32 main params
            _assert_piece(piece["main"], tensors[f"main/{name}"], piece["flat_range"], covered, f"main/{name}", where)
            saved = {k[len(f"optim/{name}/"):] for k in [*tensors, *objects] if k.startswith(f"optim/{name}/")}
            assert set(piece["state"]) == saved and saved, (where, name, sorted(piece["state"]), sorted(saved))
            for state_key, value in piece["state"].items():
                key = f"optim/{name}/{state_key}"
                if key in tensors:
                    _assert_piece(value, tensors[key], piece["flat_range"], covered, key, where)
                else:  # Adam's step count
                    _assert_same(value, objects[key], f"{where}: {key}")
        _assert_same(rec["scaler"], common["scaler"], f"{where}: scaler")
        _assert_same(rec["counters"], common["counters"], f"{where}: skip counters")
        _assert_schedule(rec["lr_scheduler"], common["lr_scheduler"], f"{where}: lr_scheduler")
        _assert_same(rec["rng"], objects[rec["rng_key"]], f"{where}: {rec['rng_key']}")
    assert sorted(covered) == sorted(tensors)
    assert all(bool(mask.all()) for mask in covered.values()), [k for k, m in covered.items() if not m.all()]
    assert sorted(r["rng_key"] for r in resumed["records"]) == sorted(k for k in objects if k.startswith("rng/"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_todays_writer_saves_the_loaded_state_as_the_fixture_holds_it(resumed):
    """The re-save right after the load (today's writer) holds the fixture's keys and bytes."""
    got_t, got_o = _read(resumed["first"] / "ckpt" / f"iter_{SAVED_AT:07d}")
    want_t, want_o = _read(resumed["fixture"] / f"iter_{SAVED_AT:07d}")
    _assert_same(got_t, want_t, "tensors")
    assert sorted(got_o) == sorted(want_o)
    for key in want_o:
        if key != "common":
            _assert_same(got_o[key], want_o[key], key)
    # what the earlier writer put in `common` is written alike (a key added since may be new; the versions differ)
    for key in set(want_o["common"]) - {"config", "torch_version", "lr_scheduler"}:
        _assert_same(got_o["common"][key], want_o["common"][key], f"common/{key}")
    _assert_schedule(got_o["common"]["lr_scheduler"], want_o["common"]["lr_scheduler"], "common/lr_scheduler")


# --- 2. the continuation, against one computed on this machine ------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_continuation_equals_a_resume_from_todays_save_bitwise(resumed):
    """Resumed from the fixture and from today's re-save of the loaded state: the same rows 5..8 and the same
    checkpoint of iteration 8, bitwise (both on this machine)."""
    first, again = (without_timing(read_rows(resumed[k])) for k in ("first", "again"))
    assert [r["iteration"] for r in first] == ITERS
    assert first == again  # == on the floats read back from JSON: bitwise
    got_t, got_o = _read(resumed["again"] / "ckpt" / "iter_0000008")
    want_t, want_o = _read(resumed["first"] / "ckpt" / "iter_0000008")
    _assert_same(got_t, want_t, "iteration 8 tensors")
    assert sorted(got_o) == sorted(want_o)
    for key in want_o:
        if key == "common":
            _assert_same(_common_without_paths(got_o[key]), _common_without_paths(want_o[key]), key)
        else:
            _assert_same(got_o[key], want_o[key], key)


# --- 3. the continuation, against the rows recorded on the writer's CPU ----------------------------------


def test_the_continuation_matches_the_recorded_run_within_rounding(resumed):
    """Rows 5..8 equal the earlier release's uninterrupted run up to other CPUs' rounding (`TOLERANCES`)."""
    case = resumed["case"]
    straight = {int(k): v for k, v in json.loads((FIXTURES / case / "straight.json").read_text()).items()}
    got = _rows(resumed["first"])
    assert sorted(got) == ITERS
    tolerances = TOLERANCES[case]
    for i in ITERS:
        exact = {k: v for k, v in got[i].items() if k not in tolerances}
        assert exact == {k: v for k, v in straight[i].items() if k not in tolerances}, i
        for key, rel in tolerances.items():
            assert got[i][key] == pytest.approx(straight[i][key], rel=rel, abs=0), (i, key)
    if case.startswith("ckpt_fp16"):
        scales = [straight[i]["loss_scale"] for i in range(1, 9)]
        assert scales[SAVED_AT - 1] != scales[-1], scales  # the scale moved after the save: its trackers count


def _write(case: str) -> None:
    """Write fixture ``case`` (from inside an empty working folder: the saved config holds relative paths
    only): the straight run's rows and the checkpoint of iteration `SAVED_AT`."""
    world, extra = CASES[case]
    out = FIXTURES / case
    shutil.rmtree(out, ignore_errors=True)
    run_distributed(run_job, world, SMALL + extra + [f"run.dir={case}/straight"])
    run_distributed(run_job, world, SMALL + extra + [f"run.dir={case}/split", f"checkpoint.save={case}/checkpoint",
                                                     f"train.exit_interval={SAVED_AT}"])
    shutil.copytree(Path(case, "checkpoint"), out / "checkpoint")
    (out / "straight.json").write_text(json.dumps(_rows(Path(case, "straight")), indent=1) + "\n")


if __name__ == "__main__":
    import os
    import tempfile

    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_checkpoint_compat.py --write")
    with tempfile.TemporaryDirectory() as tmp_dir:
        os.chdir(tmp_dir)  # before the process pool starts: its workers inherit it
        for name in sorted(CASES):
            _write(name)
