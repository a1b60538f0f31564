"""Mixed precision through `python train.py` (`run(cfg)` → metrics.jsonl / layout.json), tiny model on CPU.

1. `precision=fp16` with the default dynamic scaler (initial 2^32, hysteresis 2, growth interval
   1000): the first iterations overflow and are logged as skipped (`skipped_iter: true`,
   `grad_norm: null`); every row's `loss_scale` is what Megatron's DynamicGradScaler gives for the
   logged skip flags (re-derived here independently); `skipped_iters_total` counts them; then the
   loss falls.
   Skipped steps change no weight — checked without a checkpoint: with `train.eval_interval=1` the
   trainer evaluates the same validation batch (the split restarts on each evaluation) after every
   iteration; a forward pass of unchanged weights on unchanged data is bitwise reproducible on CPU,
   so the valid loss after each skipped iteration equals the one before training exactly, and the
   first applied step changes it.
2. 30 steps of bf16 and of fp16 with a constant scaler track fp32 (tolerances below, numbers printed);
   layout.json shows float16 / bfloat16 model params with float32 main params.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from procs import run_python

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "model.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=4",
        "parallel=tp1pp1"]
STEPS_DYNAMIC, STEPS_TRACK = 40, 30
RUNS = {  # name -> overrides of the module's single-process jobs
    "fp16_dynamic": ["precision=fp16", f"train.train_iters={STEPS_DYNAMIC}", "train.eval_interval=1",
                     "train.eval_iters=1"],
    "fp32": [f"train.train_iters={STEPS_TRACK}", "train.eval_interval=null", "precision=fp32"],
    "bf16": [f"train.train_iters={STEPS_TRACK}", "train.eval_interval=null", "precision=bf16"],
    # constant 2^12: large enough to keep the tiny model's fp16 grads normal, small enough never to overflow
    "fp16": [f"train.train_iters={STEPS_TRACK}", "train.eval_interval=null", "precision=fp16", "loss_scaler=constant",
             "loss_scaler.scale=4096"],
    "fp16_warmup": ["precision=fp16", "train.train_iters=16", "train.eval_interval=null", "optim.lr_warmup_iters=100"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)`` -> (metrics rows, layout.json) of `RUNS` [name]: `python train.py` (a child forked with torch
    imported, procs.py), world 1, two at a time from the module's first test on (suite time: each job is one
    process on one core; they ran one after another on the test pool)."""
    root = tmp_path_factory.mktemp("precision")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"

    def job(name):
        run_dir = root / name
        out = run_python(["train.py", *TINY, *RUNS[name], f"run.dir={run_dir}"], cwd=ROOT, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        layout = json.loads((run_dir / "layout.json").read_text())
        return rows, layout

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job, name) for name in RUNS}
        yield lambda name: futures[name].result()


def _megatron_scales(skipped, *, initial=2.0**32, hysteresis=2, backoff=0.5, min_scale=1.0):
    """The scale after each step for a sequence of skip flags (growth_interval 1000 is never reached here).

    Megatron DynamicGradScaler.update: on overflow the hysteresis tracker drops by one and, once it is
    <= 0, every overflow backs off (the tracker is reset only by a growth).
    """
    scale, tracker, out = initial, hysteresis, []
    for skip in skipped:
        if skip:
            tracker -= 1
            if tracker <= 0:
                scale = max(scale * backoff, min_scale)
        out.append(scale)
    return out


def test_fp16_dynamic_from_2_pow_32_skips_backs_off_keeps_weights_then_learns(runs, capsys):
    steps = STEPS_DYNAMIC
    rows, layout = runs("fp16_dynamic")
    train = [r for r in rows if r["split"] == "train"]
    valid = {r["iteration"]: r["lm_loss"] for r in rows if r["split"] == "valid"}
    assert [r["iteration"] for r in train] == list(range(1, steps + 1))
    skipped = [r["skipped_iter"] for r in train]
    first_ok = skipped.index(False)  # 0-based index of the first applied step
    with capsys.disabled():
        print(f"\n[precision] fp16 from 2^32: {first_ok} skipped steps, scale then {train[first_ok]['loss_scale']:g}; "
              f"lm_loss {train[first_ok]['lm_loss']:.4f} -> {train[-1]['lm_loss']:.4f}")
    # 2^32 overflows fp16 (max 65504) at once; hysteresis 2: the first overflow does not back off
    assert first_ok >= 2 and all(skipped[:first_ok])
    assert train[0]["loss_scale"] == 2.0**32 and train[1]["loss_scale"] == 2.0**31
    assert [r["loss_scale"] for r in train] == _megatron_scales(skipped)  # every row, exact powers of two
    for i, r in enumerate(train):
        assert r["skipped_iters_total"] == sum(skipped[: i + 1])
        assert r["nan_iters_total"] == 0  # overflow under a dynamic scaler is a skip, not a NaN iteration
        assert (r["grad_norm"] is None) == r["skipped_iter"]
    # skipped steps change no weight: the same validation batch gives the bitwise same loss
    for it in range(1, first_ok + 1):
        assert valid[it] == valid[0], (it, valid[it], valid[0])
    assert valid[first_ok + 1] != valid[0]  # ... and the first applied step does change them
    # then the loss falls: mean of the last 5 steps well below the first applied step's loss
    # (0.1 nats: the fp32 run of the same length falls by ~0.5 over these steps; a stuck run stays within noise)
    assert sum(r["lm_loss"] for r in train[-5:]) / 5 < train[first_ok]["lm_loss"] - 0.1
    assert valid[steps] < valid[0] - 0.1
    assert {(r["param_dtype"], r["main_param_dtype"]) for r in layout["ranks"]} == {("float16", "float32")}


def test_30_steps_bf16_and_fp16_constant_track_fp32(runs, capsys):
    steps = STEPS_TRACK
    runs = {name: runs(name) for name in ("fp32", "bf16", "fp16")}
    losses = {k: [r["lm_loss"] for r in rows if r["split"] == "train"] for k, (rows, _) in runs.items()}
    ref = losses["fp32"]
    diffs = {k: max(abs(a - b) for a, b in zip(losses[k], ref)) for k in ("bf16", "fp16")}
    with capsys.disabled():
        print(f"\n[precision] through run(cfg), {steps} steps: fp32 lm_loss {ref[0]:.4f} -> {ref[-1]:.4f}; "
              f"bf16 final {losses['bf16'][-1]:.4f} (max |diff| {diffs['bf16']:.4f}); "
              f"fp16 final {losses['fp16'][-1]:.4f} (max |diff| {diffs['fp16']:.4f})")
    assert all(len(v) == steps for v in losses.values())
    for k in ("bf16", "fp16"):
        rows = [r for r in runs[k][0] if r["split"] == "train"]
        assert not any(r["skipped_iter"] for r in rows) and rows[-1]["skipped_iters_total"] == 0
    assert ref[-1] < ref[0] - 0.5  # fp32 learns
    # Tolerances: bf16 keeps 8 mantissa bits (rel 2^-9 per rounding), fp16 11 bits (8x finer); fp32 main params
    # keep rounding errors from accumulating across steps. Observed on CPU: max |diff| bf16 0.0007, fp16 0.0002
    # nats while fp32 falls 6.91 -> 6.23. Bounds are 10-15x those and ~70x below the fall of the loss; a broken
    # unscale, clip or copy-back moves the curve by O(0.1-1).
    assert diffs["bf16"] < 0.01, diffs
    assert diffs["fp16"] < 0.003, diffs
    dtypes = {k: {(r["param_dtype"], r["main_param_dtype"]) for r in layout["ranks"]} for k, (_, layout) in runs.items()}
    assert dtypes["bf16"] == {("bfloat16", "float32")}
    assert dtypes["fp16"] == {("float16", "float32")}
    assert {p for p, _ in dtypes["fp32"]} == {"float32"}


def test_skipped_fp16_steps_do_not_advance_the_lr_schedule(runs):
    """Megatron: a skipped iteration counts toward train_iters but leaves the LR schedule where it was."""
    rows, _ = runs("fp16_warmup")
    train = [r for r in rows if r["split"] == "train"]
    first_ok = [r["skipped_iter"] for r in train].index(False)
    assert first_ok >= 2
    # the LR each step uses: unchanged through the skipped steps, up to and including the first applied one
    assert len({r["lr"] for r in train[: first_ok + 1]}) == 1, [r["lr"] for r in train[: first_ok + 1]]
