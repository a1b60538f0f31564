"""ZeRO-2 / ZeRO-3 (``parallel.data_parallel_sharding_strategy``, FSDP2) compute the one-process math (DESIGN.md §3).

Each pool task trains several layouts one after another (one task per world size: suite time); every job runs the
tiny model in fp32 for a few steps with two micro-batches per DP rank (gradient accumulation), and its per-step
lm_loss and grad_norm equal the single-process run's within rel 1e-5: sharding changes only the summation order
of the DP reduction (a reduce-scatter instead of an all-reduce) and of the grad norm's partial sums.

In 16-bit precisions every strategy starts from the same master weights: FSDP rounds the fp32 init through the
compute dtype before sharding, as DDP's fp32 main params are its `Float16Module`-cast params upcast.
precision=fp8 (emulated, tensorwise): each FP8 GEMM casts the weight FSDP gathered instead of a cast made once per
iteration, with the same amax and scale, so the same bits. ZeRO-3 over one process equals the one-process DDP run
bitwise at every step, and dp2 ZeRO-2 / ZeRO-3 equal it within rel 1e-5 at every step. Those fp8 runs take one
micro-batch per DP rank (two per step over one process), so that every rank sums the same grads in the same order
as DDP, and their DDP run has no gradient accumulation fusion (which adds the tied output weight's grad into its
fp32 buffer apart from the embedding lookup's, where autograd, under FSDP, sums the two in bf16 first): such
last-bit differences in the grads, like the grad norm's partial sums, which set the clip factor, are magnified by
the bf16 rounding of the weights and by the FP8 casts, to ~1e-3 in the grad norm by step 4 (seen in a 4-step run).
fp16 keeps gradient accumulation at dp2 (each micro-batch's reduce-scatter sums in another order than DDP's
buffer): its loss equals DDP's within rel 1e-5 at every step. With TP the row-parallel outputs are bf16 partial sums
reduced over TP, whose one-ulp differences an FP8 rounding step can magnify: tests/test_fp8.py's TP bounds (loss
rel 2e-3, grad norm rel 2e-2), which it explains.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job, without_timing

# 2 steps: the first (the initial weights), and one that starts from an update made of sharded grads and states;
# checkpoints of iteration 1 resume for iteration 2 (the fp16 overflow runs: 3 steps, `FP16_OVERFLOW`)
STEPS = 2
BASE = ["model=tiny", f"train.train_iters={STEPS}", "train.eval_interval=null", "train.global_batch_size=8",
        "train.micro_batch_size=2", "run.progress_bar=false"]
Z2, Z3 = "parallel.data_parallel_sharding_strategy=optim_grads", "parallel.data_parallel_sharding_strategy=optim_grads_params"
OFFLOAD = "optim.optimizer_cpu_offload=true"
HSDP2, HSDP1 = "parallel.data_parallel_shard_size=2", "parallel.data_parallel_shard_size=1"
FP8 = ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_gemm_filter=none"]
HAS_FP8 = importlib.util.find_spec("torchao") is not None  # precision=fp8 needs torchao (tests/test_fp8.py skips too)
FUSION_OFF = "parallel.gradient_accumulation_fusion=false"  # DDP's grads as autograd sums them (module docstring)
FP8_MB = "train.micro_batch_size=4"  # fp8: one micro-batch per DP rank at dp2 (module docstring)
FP8_TP_TOLERANCE = (2e-3, 2e-2)  # (loss rel, grad norm rel) with TP: tests/test_fp8.py's (module docstring)
FP8_CAST_AFTER_GATHER = "weights cast to FP8 in each GEMM after FSDP's per-layer all-gather (ZeRO-2 / ZeRO-3)"


def _jobs(rank: int, world: int, jobs: list) -> None:
    """Pool task: the training jobs ``[overrides]`` one after another."""
    for overrides in jobs:
        run_job(rank, world, BASE + overrides)


def _train(tmp_path, world: int, jobs) -> dict:
    """{name: metrics rows} of ``jobs`` ({name: overrides}, or [(name, overrides)] where a name may come back: a
    resumed job appends to its run folder) trained in one pool task of ``world`` ranks."""
    jobs = list(jobs.items()) if isinstance(jobs, dict) else list(jobs)
    run_distributed(_jobs, world, [o + [f"run.dir={tmp_path / n}"] for n, o in jobs], timeout_s=300)
    return {n: read_rows(tmp_path / n) for n, _ in jobs}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """(rows, run folder) of the one-process run."""
    tmp = tmp_path_factory.mktemp("ref")
    # beside it (same pool task): ZeRO-3 over the one rank with its fp32 shards offloaded (`test_cpu_offload`), and
    # the one-process fp8 runs, DDP and ZeRO-3 (`fp8_references`)
    fp8 = {"fp8": ["parallel=tp1pp1", *FP8, FP8_MB, FUSION_OFF],
           "fp8_z3_offload": ["parallel=tp1pp1", Z3, OFFLOAD, *FP8, FP8_MB]} if HAS_FP8 else {}
    return _train(tmp, 1, {"tp1pp1": ["parallel=tp1pp1"], "z3_offload": ["parallel=tp1pp1", Z3, OFFLOAD],
                           **fp8})["tp1pp1"], tmp / "tp1pp1"


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


@pytest.fixture(scope="module")
def fp8_references(reference_run):
    """{"ddp": rows, "zero3": rows} of the one-process fp8 runs (two micro-batches of 4), no_shard without gradient
    accumulation fusion and ZeRO-3 (offloaded: FSDP at dp 1); None without torchao."""
    tmp = reference_run[1].parent
    return {"ddp": read_rows(tmp / "fp8"), "zero3": read_rows(tmp / "fp8_z3_offload")} if HAS_FP8 else None


def _assert_same(rows: list, ref: list, name: str, rel: float = 1e-5, grad_rel: float = 1e-5, steps: int = STEPS) -> None:
    assert [r["iteration"] for r in rows] == list(range(1, steps + 1)), name
    for r, q in zip(rows, ref):
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=rel), (name, r["iteration"], r["lm_loss"], q["lm_loss"])
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=grad_rel), (name, r["iteration"], r["grad_norm"],
                                                                              q["grad_norm"])
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"], name  # it trained


# the overflow at iteration 2, then one step at the lowered scale
FP16_OVERFLOW = ["train.train_iters=3", "parallel=tp1pp1", "precision=fp16", "loss_scaler.initial_scale=1024", "loss_scaler.hysteresis=1",
                 "debug.nonfinite_grad_rank=0", "debug.nonfinite_grad_iteration=2"]


def test_dp2_zero2_and_zero3_equal_one_process(tmp_path, reference_run, fp8_references):
    """fp32 and fp8 against the one-process runs; fp16 with an overflow injected into rank 0's grads at iteration 2
    against DDP (no_shard) with the same injection: the same steps skipped, the same loss scales."""
    reference, reference_dir = reference_run
    ckpt = tmp_path / "ckpt"
    fp8 = [("fp8_z2", ["parallel=tp1pp1", Z2, *FP8, FP8_MB]),
           ("fp8_z3", ["parallel=tp1pp1", Z3, *FP8, FP8_MB])] if HAS_FP8 else []
    # dp2_z3 saves after iteration 1 and goes on; "z3_resumed" resumes that checkpoint (another seed: the checkpoint's
    # RNG and data position are what count) for iteration 2
    runs = _train(tmp_path, 2, [("dp2_z2", ["parallel=tp1pp1", Z2]),
                                ("dp2_z3", ["parallel=tp1pp1", Z3, f"checkpoint.save={ckpt}", "checkpoint.save_interval=1"]),
                                # full recompute: the layers' forwards run again inside the backward
                                ("dp2_z3_recompute", ["parallel=tp1pp1", Z3, "model.recompute_granularity=full",
                                                      "model.recompute_method=uniform", "model.recompute_num_layers=1"]),
                                ("dp2_z3_offload", ["parallel=tp1pp1", Z3, OFFLOAD]),
                                ("fp16_ddp", FP16_OVERFLOW), ("fp16_z3", FP16_OVERFLOW + [Z3]),
                                ("z3_resumed", ["parallel=tp1pp1", Z3, f"checkpoint.load={ckpt}",
                                                "checkpoint.load_iteration=1", "train.seed=999"]),
                                *fp8])
    for name in ("dp2_z2", "dp2_z3", "dp2_z3_recompute"):
        _assert_same(runs[name], reference, name)
    for name, _ in fp8:  # the one-process DDP run (its casts cached per iteration) at every step
        _assert_same(runs[name], fp8_references["ddp"], name)
        log = (tmp_path / name / "train.log").read_text()
        assert f"16 of 16 block linears (3 GEMMs each) in FP8 on this rank; {FP8_CAST_AFTER_GATHER}" in log, log
    # resume is bitwise: the floats read back from JSON are equal
    assert [r["iteration"] for r in runs["z3_resumed"]] == [2]
    assert without_timing(runs["z3_resumed"]) == without_timing(runs["dp2_z3"][1:])
    # offloaded: each rank sums its micro-batches' grads before one reduce-scatter (the same sums in another order)
    _assert_same(runs["dp2_z3_offload"], runs["dp2_z3"], "dp2_z3_offload", rel=1e-6, grad_rel=1e-6)
    assert "(ZeRO-3, FSDP2, dp=2, CPU offload)" in (tmp_path / "dp2_z3_offload" / "train.log").read_text()
    ddp, z3 = runs["fp16_ddp"], runs["fp16_z3"]
    assert [r["skipped_iter"] for r in z3] == [r["skipped_iter"] for r in ddp] == [False, True, False]
    assert [r["loss_scale"] for r in z3] == [r["loss_scale"] for r in ddp] == [1024.0, 512.0, 512.0]
    assert z3[1]["grad_norm"] is None and z3[-1]["skipped_iters_total"] == 1
    for r, q in zip(z3, ddp):  # the same fp32 master weights, fp16 compute, fp32 reduction (module docstring)
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=1e-5), (r, q)
    _assert_holds_half(tmp_path / "dp2_z3", reference_dir)


def test_cpu_offload_keeps_fsdp_at_dp1(reference_run, fp8_references):
    """optim.optimizer_cpu_offload at dp = 1: ZeRO-3 over the one rank (not the no_shard fallback), its fp32 shards
    (the whole model) held as FSDP's params and stepped there, equal to the one-process run; in fp8 (bf16 weights)
    the same floats as DDP at every step: the same master weights, grads and steps (module docstring)."""
    reference, reference_dir = reference_run
    if fp8_references is not None:
        z3, ddp = fp8_references["zero3"], fp8_references["ddp"]
        assert [r["iteration"] for r in z3] == [r["iteration"] for r in ddp] == list(range(1, STEPS + 1))
        assert [(r["lm_loss"], r["grad_norm"]) for r in z3] == [(r["lm_loss"], r["grad_norm"]) for r in ddp]
    run_dir = reference_dir.parent / "z3_offload"
    _assert_same(read_rows(run_dir), reference, "z3_offload")
    assert "data-parallel: optim_grads_params (ZeRO-3, FSDP2, dp=1, CPU offload) | this rank holds" in \
        (run_dir / "train.log").read_text()
    rank = json.loads((run_dir / "layout.json").read_text())["ranks"][0]
    ref = json.loads((reference_dir / "layout.json").read_text())["ranks"][0]
    assert rank["data_parallel_sharding_strategy"] == "optim_grads_params"
    assert rank["param_bytes"] == ref["param_bytes"] and rank["grad_bytes"] == ref["grad_bytes"]


def _assert_holds_half(run_dir, reference_dir) -> None:
    """The start-up line names the strategy; layout.json records it, and each of the two ranks holds half of the
    one-process run's params, grads and Adam state (the shards tile each TP-local tensor exactly)."""
    log = (run_dir / "train.log").read_text()
    assert "data-parallel: optim_grads_params (ZeRO-3, FSDP2, dp=2) | this rank holds params" in log, log
    assert "norm=mptrain.layers.norms.LayerNorm (" in log and "FSDPLayerNorm" not in log, log  # the norm's own class
    ref = json.loads((reference_dir / "layout.json").read_text())["ranks"][0]
    ranks = json.loads((run_dir / "layout.json").read_text())["ranks"]
    assert ref["data_parallel_sharding_strategy"] == "no_shard" and ref["grad_bytes"] == ref["param_bytes"]
    assert [r["data_parallel_sharding_strategy"] for r in ranks] == ["optim_grads_params"] * 2
    assert sum(r["param_bytes"] for r in ranks) == ref["param_bytes"]  # fp32 shards, no padding stored
    assert sum(r["grad_bytes"] for r in ranks) == ref["grad_bytes"]
    full = ref["param_bytes"]  # fp32: the whole model's bytes
    for r in ranks:
        # per iteration (2 micro-batches): each gathers every unit twice (forward, backward) and the root once, and
        # reduce-scatters the fp32 grads, half of each on the wire at dp 2: (2 + the units' share) × the model's
        # bytes; the root (tied embedding, final norm) is about a quarter of the tiny model, so 2.5 to 3 times
        assert 2.5 * full < r["bytes_sent"]["dp"] < 3 * full, (r["bytes_sent"], full)
        assert r["param_bytes"] == pytest.approx(ref["param_bytes"] / 2, rel=0.05)
        # Adam's moments of the shards (+ a 4-byte step per tensor on each rank)
        assert r["optimizer_state_bytes"] == pytest.approx(ref["optimizer_state_bytes"] / 2, rel=0.05)
        assert r["main_param_dtype"] is None and r["param_dtype"] == "float32"  # fp32: the shards are stepped


def test_tp2_and_pp2_by_dp2_equal_one_process(tmp_path, reference, fp8_references):
    # tp2 x dp2 with SP (norm grads all-reduced over TP on the shards), pp2 x dp2 (the tied embedding's copies
    # reduced over the embedding group on the shards), interleaved pp2 vpp2 x dp2
    # evaluation in between (forward only: ZeRO-2 leaves the params gathered) changes nothing in training
    # HSDP: dp4 = shard 2 x replicate 2 (grads reduce-scattered within [0,1] / [2,3], the shards all-reduced across
    # [0,2] / [1,3]), with two micro-batches per rank; its checkpoint of iteration 1 resumed by DDP at tp2 x pp2
    # (dp 1), which trains iteration 2 as the one-process run
    # fp8 at tp2 x dp2 ZeRO-3: the gathered TP shard's cast, its amax reduced over TP (tp1's scales); 2 steps: the
    # casts of the first, and one after an update
    evaluate = ["train.eval_interval=1", "train.eval_iters=1"]
    ckpt = tmp_path / "hsdp_ckpt"
    fp8 = [("fp8_tp2dp2_z3", ["parallel=tp2pp1", Z3, *FP8, FP8_MB, "train.train_iters=2"])] if HAS_FP8 else []
    runs = _train(tmp_path, 4, [("tp2dp2_sp_z3", ["parallel=tp2pp1", "parallel.sequence_parallel=true", Z3, *evaluate]),
                                ("tp2dp2_z2", ["parallel=tp2pp1", Z2]),
                                ("pp2dp2_z3", ["parallel=tp1pp2", Z3]),
                                ("pp2vpp2dp2_z2", ["parallel=tp1pp2vpp2", Z2, *evaluate]),
                                ("hsdp_z3", ["parallel=tp1pp1", Z3, HSDP2, "train.micro_batch_size=1",
                                             f"checkpoint.save={ckpt}", "checkpoint.save_interval=1"]),
                                ("hsdp_z2", ["parallel=tp1pp1", Z2, HSDP2]),
                                ("hsdp_to_tp2pp2", ["parallel=tp2pp2", f"checkpoint.load={ckpt}",
                                                    "checkpoint.load_iteration=1"]),
                                *fp8])
    resumed = runs.pop("hsdp_to_tp2pp2")
    for name, _ in fp8:
        _assert_same(runs.pop(name), fp8_references["ddp"], name, *FP8_TP_TOLERANCE, steps=2)
        assert FP8_CAST_AFTER_GATHER in (tmp_path / name / "train.log").read_text()
    for name, rows in runs.items():
        _assert_same(rows, reference, name)
    assert [r["iteration"] for r in resumed] == [2]
    for r, q in zip(resumed, reference[1:]):
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=1e-5), (r, q)
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-5), (r, q)
    ranks = json.loads((tmp_path / "hsdp_z3" / "layout.json").read_text())["ranks"]
    # each rank holds half of the model (its shard group's half), the replicas the same halves
    assert ranks[0]["param_bytes"] == ranks[2]["param_bytes"] and ranks[1]["param_bytes"] == ranks[3]["param_bytes"]
    assert "data-parallel: optim_grads_params (ZeRO-3, FSDP2, dp=4, HSDP shard 2 x replicate 2)" in \
        (tmp_path / "hsdp_z3" / "train.log").read_text()
    for name in ("tp2dp2_sp_z3", "pp2vpp2dp2_z2"):
        valid = read_rows(tmp_path / name, "valid")
        assert [r["iteration"] for r in valid] == [0, 1, 2], name
        # iteration 0: the untrained model; both layouts evaluate the same batches
        assert valid[0]["lm_loss"] == pytest.approx(read_rows(tmp_path / "tp2dp2_sp_z3", "valid")[0]["lm_loss"], rel=1e-5)


# --- the key's rules (no process) -----------------------------------------------------------------
@pytest.mark.parametrize("overrides,words", [
    (["parallel.data_parallel_sharding_strategy=no_shard", "parallel.use_distributed_optimizer=true"],
     ["data_parallel_sharding_strategy=no_shard", "use_distributed_optimizer=true"]),
    (["parallel.data_parallel_sharding_strategy=zero3"], ["data_parallel_sharding_strategy", "'zero3'", "optim_grads"]),
    ([Z3, "model.num_moe_experts=4", HSDP1], ["data_parallel_shard_size=1", "model.num_moe_experts=4"]),
    # with context parallelism the shard groups tile dp × cp (1 × 2 here)
    ([Z3, "parallel.context_parallel_size=2", "parallel.data_parallel_shard_size=4"],
     ["data_parallel_shard_size=4", "data-parallel size 2", "[1, 2]"]),
    ([Z2, "parallel.use_distributed_optimizer=true", "parallel.overlap_grad_reduce=true",
      "parallel.overlap_param_gather=true"], ["overlap_param_gather", "optim_grads"]),
    # HSDP: the shard size divides dp (2 here); only the strategies that shard grads / params take it
    ([Z3, "parallel.data_parallel_shard_size=4"], ["data_parallel_shard_size=4", "data-parallel size 2", "[1, 2]"]),
    ([HSDP1, "parallel.use_distributed_optimizer=true"], ["data_parallel_shard_size=1", "optim_grads_params", "optim"]),
    ([HSDP1], ["data_parallel_shard_size=1", "no_shard"]),
    (["optim.optimizer_cpu_offload=true", "parallel.use_distributed_optimizer=true"],
     ["optim.optimizer_cpu_offload=true", "optim_grads_params", "not optim"]),
])
def test_refused_before_any_collective(overrides, words):
    from train_utils import compose

    from mptrain.config.schema import as_config
    from mptrain.errors import ConfigError
    from mptrain.training.validate import validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(as_config(compose(BASE + overrides)), 2)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_context_parallelism_shards_over_dp_and_cp():
    """ZeRO-2 / ZeRO-3 with cp > 1 pass validation; the strategy runs wherever dp × cp > 1 (cp2 alone shards)."""
    from train_utils import compose

    from mptrain.config.schema import as_config
    from mptrain.distributed.strategy import running_strategy
    from mptrain.training.validate import validate_config

    for strategy, world in ((Z3, 4), (Z2, 2)):
        cfg = as_config(compose(BASE + [strategy, "parallel.context_parallel_size=2"]))
        derived = validate_config(cfg, world)
        assert (derived.data_parallel_size, derived.context_parallel_size) == (world // 2, 2)
        assert running_strategy(cfg, derived.data_parallel_size * 2) == strategy.split("=")[1]


def test_strategy_resolution():
    from types import SimpleNamespace

    from mptrain.distributed.strategy import sharding_strategy

    def par(strategy, zero1=False):
        return SimpleNamespace(data_parallel_sharding_strategy=strategy, use_distributed_optimizer=zero1)

    assert sharding_strategy(par(None)) == "no_shard" and sharding_strategy(par(None, True)) == "optim"
    assert sharding_strategy(par("optim")) == "optim"  # use_distributed_optimizer's other spelling
    assert sharding_strategy(par("optim_grads_params", True), 4) == "optim_grads_params"  # Megatron-FSDP sets both
    assert sharding_strategy(par("optim_grads_params"), 1) == "no_shard"  # nothing to shard at dp 1


def test_megatron_fsdp_arguments_translate(capsys):
    from mptrain.from_megatron import main

    args = ["--world-size", "4", "--", "--num-layers", "2", "--use-distributed-optimizer", "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy", "optim_grads_params"]
    assert main(args) == 0
    assert "parallel.data_parallel_sharding_strategy=optim_grads_params" in capsys.readouterr().out
    # without --use-megatron-fsdp Megatron does not read the strategy: not written (it would contradict ZeRO-1)
    assert main(args[:6] + args[7:]) == 0
    out, err = capsys.readouterr()
    assert "data_parallel_sharding_strategy" not in out and "--data-parallel-sharding-strategy" in err
    # HSDP: 2 instances of dp 4 shard within groups of 2; offload of the shards. Under ZeRO-1 neither is carried
    hsdp = ["--num-distributed-optimizer-instances", "2", "--optimizer-cpu-offload"]
    assert main(args + hsdp) == 0
    out = capsys.readouterr().out
    assert "parallel.data_parallel_shard_size=2" in out and "optim.optimizer_cpu_offload=true" in out
    assert main(args[:6] + hsdp) == 0
    out, err = capsys.readouterr()
    assert "data_parallel_shard_size" not in out and "optimizer_cpu_offload" not in out
    assert "--num-distributed-optimizer-instances" in err and "--optimizer-cpu-offload" in err


def test_optim_is_use_distributed_optimizer():
    """``optim`` spelled as the strategy is ZeRO-1 for every reader, the param all-gather's rules included."""
    from train_utils import compose

    from mptrain.config.schema import as_config
    from mptrain.training.validate import validate_config

    cfg = as_config(compose(BASE + ["parallel.data_parallel_sharding_strategy=optim", "parallel.overlap_grad_reduce=true",
                                    "parallel.overlap_param_gather=true"]))
    assert cfg.parallel.use_distributed_optimizer is True
    assert validate_config(cfg, 2).data_parallel_size == 2
