"""Context parallelism end to end through `run(cfg)`: every CP layout computes the single-process math.

The tiny model (fp32, dropout 0, mock data, RoPE and learned positions, document masking from offsets or the
dense mask) trains a few steps at cp1 on one process and under cp2 layouts; lm_loss and grad_norm must agree per
step to rel 1e-5 (DESIGN.md §3); in bf16, fp16 (with the loss scaler) and fp8 to the dtype's rounding
(`HALF_TOLERANCE`, `FP8_TOLERANCE`).
"""

import importlib.util
import json
from pathlib import Path

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job

# 2 steps: the first, and one after an update (the cp ranks' grads reduced and stepped); checkpoints hold
# iteration 1 and resume for iteration 2
STEPS = 2
BASE = ["model=tiny", f"train.train_iters={STEPS}", "train.eval_interval=null", "train.global_batch_size=4",
        "train.micro_batch_size=2"]


def _jobs(rank, world, jobs):
    """Pool task: several training jobs one after another on the same processes (one pool call)."""
    return [run_job(rank, world, overrides) for overrides in jobs]


def _run(tmp: Path, world: int, named: dict) -> dict:
    """{name: train rows}, and {name + "/valid": valid rows} for the jobs that evaluated."""
    jobs = [BASE + overrides + [f"run.dir={tmp / name}"] for name, overrides in named.items()]
    run_distributed(_jobs, world, jobs, timeout_s=300)
    rows = {name: read_rows(tmp / name) for name in named}
    return {**rows, **{f"{name}/valid": read_rows(tmp / name, "valid") for name in named if EVAL[0] in named[name]}}


def _assert_same(rows, ref, rel=1e-5, grad_rel=None):
    assert [r["iteration"] for r in rows] == list(range(1, STEPS + 1))
    for r, q in zip(rows, ref):
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=rel), (r["iteration"], r["lm_loss"], q["lm_loss"])
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=grad_rel or rel), (
            r["iteration"], r["grad_norm"], q["grad_norm"])
        assert r["consumed_samples"] == q["consumed_samples"]
        assert r["skipped_iter"] == q["skipped_iter"] and r["loss_scale"] == q["loss_scale"]
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]


ROPE = ["model.position_embedding_type=rope"]
RECOMPUTE = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
CP2 = ["parallel.context_parallel_size=2"]
Z2, Z3 = "parallel.data_parallel_sharding_strategy=optim_grads", "parallel.data_parallel_sharding_strategy=optim_grads_params"
EVAL = [f"train.eval_interval={STEPS}", "train.eval_iters=1"]
MASK = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true",
        "data.create_attention_mask_in_dataloader=true"]
# document offsets (no dense mask); mock ids run mod data.vocab_size, so with vocab 13 (EOD = 12) each 64-token sample
# holds about five documents of at most 13 tokens, cut at other places in each: at cp2 (chunks of 16) every diagonal
# and neighbouring chunk pair is a masked block and every pair further apart is skipped (tests/test_cp_attention.py
# covers the other kinds); with RoPE, whose positions (reset at each document) every pipeline stage applies (learned
# positions with reset position ids: MASK)
DOCS = ["data.vocab_size=13", "data.reset_attention_mask=true", "data.reset_position_ids=true",
        "data.eod_mask_loss=true", *ROPE]
BF16 = ["precision=bf16"]
FP16 = ["precision=fp16", "loss_scaler.initial_scale=65536"]
# Half precision: cp1 and cp2 round differently (the ring merges per-block results in fp32 where cp1 runs one
# softmax, and K/V grads are summed over blocks in fp32 before one rounding), so the runs agree to the dtype's
# rounding, not bitwise. The loss is a mean over 512 tokens in fp32 (rounding errors of the half logits average
# out), the grad norm carries the rounding of every half grad: (loss rel, grad norm rel) bf16 (eps 2^-8 ≈ 4e-3)
# 1e-4, 1e-2; fp16 (eps 2^-11 ≈ 5e-4) 5e-5, 2.5e-3: a few times what 3 steps show on CPU (bf16 8e-6 and 1.8e-3,
# fp16 6e-6 and 4.7e-4).
HALF_TOLERANCE = {"bf16": (1e-4, 1e-2), "fp16": (5e-5, 2.5e-3)}
# FP8 GEMMs (emulated, tensorwise) on bf16 activations: every CP rank casts with cp1's scales (the amaxes over tokens
# are reduced over CP; tests/test_fp8.py checks the linears bitwise), but the ring's bf16 merges round attention
# outputs differently from cp1, and a value one bf16 ulp off may land on the other side of an FP8 rounding step
# (e4m3: 3 mantissa bits), so the difference grows past bf16's: (loss rel, grad norm rel) 5e-4, 2e-2, a few times
# what 3 steps show on CPU (8e-5 and 3.3e-3); tests/test_fp8.py allows tp2 2e-3, 2e-2
FP8 = ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_gemm_filter=none"]
FP8_TOLERANCE = (5e-4, 2e-2)
HAS_FP8 = importlib.util.find_spec("torchao") is not None  # precision=fp8 needs torchao (tests/test_fp8.py skips too)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """The cp1 runs' folders (one per name of `references`)."""
    return tmp_path_factory.mktemp("cp1")


@pytest.fixture(scope="module")
def references(reference_dir):
    fp8 = {"fp8": FP8} if HAS_FP8 else {}
    return _run(reference_dir, 1, {"rope": ROPE + EVAL, "mask": MASK, "docs": DOCS, "bf16": BF16, "fp16": FP16,
                                   **fp8})


def test_cp2_world2_equals_cp1(tmp_path, references):
    runs = _run(tmp_path, 2, {
        # the p2p ring (the default) in training and in evaluation; learned positions at cp2: all_gather_mask
        "p2p_rope_recompute": CP2 + ROPE + RECOMPUTE + EVAL,
        "all_gather_rope": CP2 + ROPE + ["parallel.cp_comm_type=all_gather"],
        "a2a_rope": CP2 + ROPE + ["parallel.cp_comm_type=a2a"],
        "all_gather_mask": CP2 + MASK + ["parallel.cp_comm_type=all_gather"],
        "p2p_docs_recompute": CP2 + DOCS + RECOMPUTE,
        "p2p_bf16": CP2 + BF16,
        "p2p_fp16": CP2 + FP16,
        **({"p2p_fp8": CP2 + FP8} if HAS_FP8 else {}),
    })
    _assert_same(runs["p2p_rope_recompute"], references["rope"])
    valid, ref_valid = runs["p2p_rope_recompute/valid"], references["rope/valid"]
    assert [r["iteration"] for r in valid] == [0, STEPS] == [r["iteration"] for r in ref_valid]
    for r, q in zip(valid, ref_valid):  # evaluation at cp2: the whole sequences' loss
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=1e-5)
    _assert_same(runs["all_gather_rope"], references["rope"])
    _assert_same(runs["a2a_rope"], references["rope"])
    _assert_same(runs["all_gather_mask"], references["mask"])
    _assert_same(runs["p2p_docs_recompute"], references["docs"])
    log = (tmp_path / "p2p_docs_recompute" / "train.log").read_text()
    assert "attention=documents (ring blocks from document ids" in log
    for dtype, (loss_rel, grad_rel) in HALF_TOLERANCE.items():
        _assert_same(runs[f"p2p_{dtype}"], references[dtype], rel=loss_rel, grad_rel=grad_rel)
    if HAS_FP8:
        _assert_same(runs["p2p_fp8"], references["fp8"], rel=FP8_TOLERANCE[0], grad_rel=FP8_TOLERANCE[1])
        assert "precision=fp8 (tensorwise, emulated: 16 of 16 block linears" in (
            tmp_path / "p2p_fp8" / "train.log").read_text()


TP2_SP = ["parallel=tp2pp1", "parallel.sequence_parallel=true"]
# pp2 and dp2 with the ring's document blocks (DOCS: RoPE, the positions every stage applies, reset per document);
# the causal ring's other blocks beside dp2: the ZeRO runs (dp2 x cp2) here; a stage runs its layers' rings as at pp1
LAYOUTS_4 = {"cp2pp2": ["parallel=tp1pp2"], "cp2dp2_zero1": ["parallel.use_distributed_optimizer=true"]}


def test_cp2_layouts_on_4_processes_equal_cp1(tmp_path, references, reference_dir):
    runs = _run(tmp_path, 4, {
        # TP splits the heads inside the ring: the causal blocks (RoPE) and the document blocks (DOCS)
        "tp2cp2_sp": CP2 + ROPE + TP2_SP,
        "tp2cp2_sp_docs": CP2 + DOCS + TP2_SP,
        **{name: CP2 + DOCS + layout for name, layout in LAYOUTS_4.items()},
        # ZeRO-2 / ZeRO-3: FSDP2 shards over the 4 dp × cp ranks (grads reduce-scattered there, the grad norm summed
        # there once); HSDP shard 2: within each cp pair [0,1] / [2,3], replicated across dp
        "cp2dp2_zero2": CP2 + ROPE + [Z2],
        "cp2dp2_zero3": CP2 + ROPE + [Z3],
        "cp2dp2_zero3_hsdp": CP2 + ROPE + [Z3, "parallel.data_parallel_shard_size=2"],
    })
    for name, rows in runs.items():
        _assert_same(rows, references["docs" if name.endswith("_docs") or name in LAYOUTS_4 else "rope"])
    ref = json.loads((reference_dir / "rope" / "layout.json").read_text())["ranks"][0]
    z3 = json.loads((tmp_path / "cp2dp2_zero3" / "layout.json").read_text())["ranks"]
    assert [r["data_parallel_sharding_strategy"] for r in z3] == ["optim_grads_params"] * 4
    assert sum(r["param_bytes"] for r in z3) == ref["param_bytes"]  # the shards tile the model over dp × cp
    assert sum(r["grad_bytes"] for r in z3) == ref["grad_bytes"]
    assert all(r["param_bytes"] == pytest.approx(ref["param_bytes"] / 4, rel=0.05) for r in z3)
    assert "data-parallel: optim_grads_params (ZeRO-3, FSDP2, dp=2, cp=2) | this rank holds" in \
        (tmp_path / "cp2dp2_zero3" / "train.log").read_text()
    hsdp = json.loads((tmp_path / "cp2dp2_zero3_hsdp" / "layout.json").read_text())["ranks"]
    # shard groups [0,1] / [2,3]: each holds the whole model in halves, the replicas (0 and 2) the same half
    assert hsdp[0]["param_bytes"] + hsdp[1]["param_bytes"] == ref["param_bytes"]
    assert hsdp[0]["param_bytes"] == hsdp[2]["param_bytes"] and hsdp[1]["param_bytes"] == hsdp[3]["param_bytes"]
    assert "(ZeRO-3, FSDP2, dp=2, cp=2, HSDP shard 2 x replicate 2)" in \
        (tmp_path / "cp2dp2_zero3_hsdp" / "train.log").read_text()
    # layout.json: each rank's coordinates in the tp-cp-dp-pp order
    coords = {name: [(r["tp"], r["cp"], r["dp"], r["pp"]) for r in json.loads((tmp_path / name / "layout.json")
                                                                             .read_text())["ranks"]] for name in runs}
    assert coords["tp2cp2_sp"] == [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0)]
    assert coords["cp2pp2"] == [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1), (0, 1, 0, 1)]
    assert coords["cp2dp2_zero1"] == [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 1, 1, 0)]


def test_resume_at_cp2_is_bitwise_and_a_cp2_checkpoint_resumes_at_cp1(tmp_path, references):
    from train_utils import without_timing

    common = CP2 + ROPE + ["parallel.use_distributed_optimizer=true"]  # ZeRO-1 shards Adam's state over dp × cp
    ckpt, ckpt_z3 = tmp_path / "ckpt", tmp_path / "ckpt_z3"
    # ZeRO-3 too: FSDP's params, grads and Adam's state sharded over the 2 cp ranks (dp × cp), saved and resumed
    zero3 = CP2 + ROPE + [Z3]
    # the straight runs save after iteration 1 and go on; each resumes from that checkpoint (a stop by
    # train.exit_interval and its resume: tests/test_checkpoint_resume.py)
    every = ["checkpoint.save_interval=1"]
    runs = _run(tmp_path, 2, {"straight": common + every + [f"checkpoint.save={ckpt}"],
                              "straight_z3": zero3 + every + [f"checkpoint.save={ckpt_z3}"]})
    resumed = _run(tmp_path, 2, {"resumed": common + [f"checkpoint.load={ckpt}", "checkpoint.load_iteration=1"],
                                 "resumed_z3": zero3 + [f"checkpoint.load={ckpt_z3}", "checkpoint.load_iteration=1"]})
    assert [r["iteration"] for r in resumed["resumed"]] == [2] == [r["iteration"] for r in resumed["resumed_z3"]]
    # bitwise: the floats read back from JSON are equal
    assert without_timing(resumed["resumed"]) == without_timing(runs["straight"][1:])
    assert without_timing(resumed["resumed_z3"]) == without_timing(runs["straight_z3"][1:])
    _assert_same(runs["straight"], references["rope"])
    _assert_same(runs["straight_z3"], references["rope"])
    at_cp1 = _run(tmp_path, 1, {"cp1": ROPE + [f"checkpoint.load={ckpt}", "checkpoint.load_iteration=1"]})["cp1"]
    assert [r["iteration"] for r in at_cp1] == [2]
    for key in ("lm_loss", "grad_norm"):
        assert at_cp1[0][key] == pytest.approx(references["rope"][1][key], rel=1e-5), key
