"""The planner: model-state bytes equal what the trainer allocates; gpt_6.7b verdicts; JSON schema.

Model states are measured from the trainer's own objects (`training.run.build_model_and_optimizer`
on gloo processes, after one optimizer step so Adam's state exists) and compared with the
planner's formulas per rank, part by part.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import run_distributed
from mptrain.planner.config import compose_plan
from procs import forkserver, run_python

ROOT = Path(__file__).resolve().parents[1]
SHARDING = "parallel.data_parallel_sharding_strategy"
TOL = 0.02  # required: within 2 % (the formulas ignore bucket padding and Adam's scalar `step` tensors)


def _cfg(overrides):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose_plan(overrides))


def _measure_rank(rank, world, cfg, vocab_size):
    import torch

    from mptrain.training.validate import validate_config
    from mptrain.groups import build_groups
    from mptrain.planner.layouts import config_layout, layout_config
    from mptrain.planner.measure import layers_of, measured_rank_bytes
    from mptrain.planner.memory import model_state_bytes
    from mptrain.planner.params import rank_params
    from mptrain.training.layout import optimizer_state_bytes
    from mptrain.training.run import build_model_and_optimizer

    derived = validate_config(cfg, world)
    groups = build_groups(derived.tensor_model_parallel_size, derived.pipeline_model_parallel_size,
                          derived.virtual_pipeline_model_parallel_size,
                          expert_model_parallel_size=derived.expert_model_parallel_size,
                          expert_tensor_parallel_size=derived.expert_tensor_parallel_size,
                          data_parallel_shard_size=cfg.parallel.data_parallel_shard_size)
    try:
        torch.manual_seed(0)
        chunks, optimizer, *_ = build_model_and_optimizer(cfg, groups, derived, vocab_size=vocab_size)
        for chunk in chunks:
            if not chunk.grad_buffers:  # ZeRO-2 / ZeRO-3 hold no grad before a backward: zero shards, as DDP's
                chunk.finish_grad_sync()
        result = optimizer.step().result()  # zero grads: a real step that creates Adam's state
        assert result.update_successful
        measured = measured_rank_bytes(chunks, optimizer)
        layout = config_layout(cfg, derived)
        rp = rank_params(cfg.model, layout_config(cfg, layout).parallel, vocab_size=vocab_size,
                         pp_rank=groups.pp_rank, tp_rank=groups.tp_rank)
        zero1_state = optimizer.optimizer_state_bytes() if cfg.parallel.use_distributed_optimizer else None
        return {"measured": measured, "planned": model_state_bytes(cfg, layout, rp), "numel": rp.numel,
                "num_params": rp.num_params, "layers": layers_of(chunks), "planned_layers": list(rp.layers),
                "inner_state": optimizer_state_bytes(optimizer.optimizer), "zero1_state": zero1_state}
    finally:
        groups.destroy()


CASES = [  # (model overrides, world, layout overrides)
    (["model=tiny"], 1, ["parallel=tp1pp1", "precision=fp32"]),
    (["model=tiny"], 2, ["parallel=tp2pp1", "precision=bf16"]),
    (["model=tiny"], 2, ["parallel=tp1pp2", "precision=fp32"]),
    (["model=tiny"], 2, ["parallel=tp1pp1", "precision=bf16", "parallel.use_distributed_optimizer=true"]),
    # gpt_125m's vocabulary and width with 2 of its 12 layers (every layer holds the same bytes; the tiny cases hold
    # 4): TP shards, one layer a stage, ZeRO-1
    (["model=gpt_125m", "model.num_layers=2"], 2, ["parallel=tp2pp1", "precision=bf16"]),
    (["model=gpt_125m", "model.num_layers=2"], 2, ["parallel=tp1pp2", "precision=fp32"]),
    (["model=gpt_125m", "model.num_layers=2"], 2, ["parallel=tp1pp1", "precision=bf16",
                                                   "parallel.use_distributed_optimizer=true",
                                                   "parallel.bucket_size=10000000"]),
    # MoE layers on the odd layers only: the stages hold different parameter counts
    (["model=moe_tiny", "model.moe_layer_freq=[0,1,0,1]", "model.moe_shared_expert_intermediate_size=32"], 2,
     ["parallel=tp1pp2", "precision=bf16"]),
    # the experts sharded over the TP ranks, the router replicated; or whole on each TP rank
    (["model=moe_tiny", "model.moe_shared_expert_intermediate_size=32", "model.moe_shared_expert_gate=true"], 2,
     ["parallel=tp2pp1", "parallel.sequence_parallel=true", "precision=bf16"]),
    (["model=moe_tiny"], 2, ["parallel=tp2pp1", "parallel.sequence_parallel=true",
                             "parallel.expert_tensor_parallel_size=1", "precision=fp32"]),
    # expert parallelism: 2 of the 4 experts a rank; under ZeRO-1 their state sharded over expert-DP (2 ranks),
    # the dense weights' over DP (4 ranks)
    (["model=moe_tiny"], 2, ["parallel=tp1pp1", "parallel.expert_model_parallel_size=2", "precision=bf16"]),
    (["model=moe_tiny", "model.moe_shared_expert_intermediate_size=32"], 4,
     ["parallel=tp1pp1", "parallel.expert_model_parallel_size=2", "precision=bf16",
      "parallel.use_distributed_optimizer=true"]),
    # ZeRO-3 at dp 2, ZeRO-2 at dp 4, ZeRO-3 HSDP at dp 4 = shard 2 × replicate 2: 1/S of every part on a rank
    (["model=tiny"], 2, ["parallel=tp1pp1", "precision=bf16", f"{SHARDING}=optim_grads_params"]),
    (["model=tiny"], 4, ["parallel=tp1pp1", "precision=fp32", f"{SHARDING}=optim_grads"]),
    (["model=tiny"], 4, ["parallel=tp1pp1", "precision=bf16", f"{SHARDING}=optim_grads_params",
                         "parallel.data_parallel_shard_size=2"]),
]


@pytest.mark.parametrize("model, world, layout", CASES, ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_model_states_equal_what_the_trainer_allocates(model, world, layout):
    from mptrain.data.tokenizers import build_tokenizer, check_vocab_size

    cfg = _cfg([*model, *layout, f"world_size={world}", "train.global_batch_size=8", "train.micro_batch_size=2"])
    vocab = check_vocab_size(cfg.model.vocab_size, build_tokenizer(cfg.data).vocab_size)
    out = run_distributed(_measure_rank, world, cfg, vocab)
    for r, o in enumerate(out):
        m, p = o["measured"], o["planned"]
        assert o["numel"] == m["numel"], (r, o["numel"], m["numel"])  # exact: same shapes
        assert o["num_params"] == m["num_params"]  # layout.json's num_params convention, exact
        assert o["layers"] == o["planned_layers"]
        for key in ("weights", "grads", "main_params", "optimizer_state"):
            assert m[key] == pytest.approx(p[key], rel=TOL, abs=64), (r, key, m[key], p[key])
        assert sum(m[k] for k in p) == pytest.approx(sum(p.values()), rel=TOL)
        assert o["inner_state"] == pytest.approx(p["optimizer_state"], rel=TOL)
        if o["zero1_state"] is not None:  # DistributedOptimizer.optimizer_state_bytes: main pieces + state
            assert o["zero1_state"] == pytest.approx(p["main_params"] + p["optimizer_state"], rel=TOL)
    shards = 2 if "parallel.data_parallel_shard_size=2" in layout else world
    if any(o.startswith(SHARDING) for o in layout):
        # every part is 1/S of no_shard's fp32 bytes, exactly here (the tiny model's rows divide by S): fp32 shards
        # (the master weights: no main params), fp32 grad shards, Adam's two moments of the shard
        for o in out:
            m = o["measured"]
            assert (m["weights"], m["grads"], m["main_params"]) == (4 * m["numel"] / shards, 4 * m["numel"] / shards, 0)
            # + Adam's 4-byte `step` per tensor (52 of them here: 208 bytes, 0.02 %)
            assert o["inner_state"] == pytest.approx(8 * m["numel"] / shards, rel=1e-3)
    elif "precision=bf16" in layout and "parallel.use_distributed_optimizer=true" not in layout:
        # bf16: 2 (weights) + 4 (fp32 grads) + 4 (main) + 8 (Adam) bytes per element, exactly
        m = out[0]["measured"]
        assert (m["weights"], m["grads"], m["main_params"]) == (2 * m["numel"], 4 * m["numel"], 4 * m["numel"])


def _plan(overrides):
    from mptrain.plan import plan_from_config

    return plan_from_config(compose_plan(overrides))[1]


def test_gpt_6_7b_tp1pp1_without_zero1_does_not_fit_80gib_and_an_8_gpu_layout_does():
    records = _plan(["model=gpt_6.7b", "precision=bf16", "world_size=8", "train.micro_batch_size=1",
                     "train.global_batch_size=64"])
    base = [r for r in records if (r["tp"], r["pp"], r["use_distributed_optimizer"]) == (1, 1, False)]
    assert {r["recompute"] for r in base} == {"none", "selective", "full"}
    for r in base:
        mem = r["memory_gib"]
        states = mem["weights"] + mem["grads"] + mem["main_params"] + mem["optimizer_state"]
        # 18 bytes × 6,658,596,864 params (padded vocab 50304) = 111.6 GiB; 0.5 GiB slack for rounding the "≈ 112"
        assert states == pytest.approx(111.6, abs=0.5)
        assert r["fits"] is False and mem["total"] > 80
    fitting = [r for r in records if r["fits"]]
    assert fitting and records[0]["fits"]  # ranked: fitting layouts first
    assert all(r["memory_gib"]["total"] <= 80 for r in fitting)
    one_gpu = _plan(["model=gpt_6.7b", "precision=bf16", "world_size=1", "train.micro_batch_size=1",
                     "train.global_batch_size=8"])
    assert one_gpu and not any(r["fits"] for r in one_gpu)


def test_bubble_and_inflight_formulas():
    from mptrain.planner.layouts import bubble_fraction
    from mptrain.planner.memory import PlanLayout, inflight_microbatches

    assert bubble_fraction(PlanLayout(1, 4, None, 2, False, "none", False, "1f1b", 8)) == 3 / 11
    assert bubble_fraction(PlanLayout(1, 4, 2, 2, False, "none", False, "interleaved_1f1b", 8)) == 3 / 19
    assert bubble_fraction(PlanLayout(8, 1, None, 1, False, "none", False, "no_pipelining", 8)) == 0.0
    assert [inflight_microbatches("1f1b", pp=4, vpp=None, m=8, pp_rank=r) for r in range(4)] == [4, 3, 2, 1]
    assert [inflight_microbatches("1f1b", pp=4, vpp=None, m=2, pp_rank=r) for r in range(4)] == [2, 2, 2, 1]
    assert [inflight_microbatches("gpipe", pp=4, vpp=None, m=3, pp_rank=r) for r in range(4)] == [3, 3, 3, 3]
    # interleaved (Megatron warmup 2(pp-r-1) + (vpp-1)pp, +1 steady): pp 4 vpp 2 m 8 -> 11, 9, 7, 5 chunk-micro-batches
    assert [inflight_microbatches("interleaved_1f1b", pp=4, vpp=2, m=8, pp_rank=r) for r in range(4)] == [11, 9, 7, 5]


def _interleaved_inflight(rank, world, m):
    from test_schedules import EVEN, _run_schedule

    return _run_schedule(rank, world, "interleaved_1f1b", world, 2, m, EVEN)["inflight"]


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_interleaved_inflight_matches_the_schedule(pp, m):
    from mptrain.planner.memory import inflight_microbatches

    measured = run_distributed(_interleaved_inflight, pp, m)
    assert measured == [inflight_microbatches("interleaved_1f1b", pp=pp, vpp=2, m=m, pp_rank=r) for r in range(pp)]


def test_json_output_schema_and_table():
    args = ["-m", "mptrain.plan", "model=gpt_1.3b", "precision=bf16", "world_size=4",
            "train.micro_batch_size=1", "train.global_batch_size=16"]
    # the four commands side by side (suite time: each is one process on one core)
    with ThreadPoolExecutor(4) as pool:
        out, table, bad, nope = pool.map(lambda a: run_python(a, cwd=ROOT, timeout=300),
                                         [[*args, "format=json"], args, [*args, "format=xml"], [*args, "model=nope"]])
    assert out.returncode == 0, out.stderr
    records = json.loads(out.stdout)
    assert isinstance(records, list) and records
    parts = {"weights", "grads", "main_params", "optimizer_state", "activations", "logits", "optimizer_workspace",
             "gathered", "offloaded", "total"}
    for r in records:
        assert {"tp", "pp", "vpp", "dp", "ep", "edp", "use_distributed_optimizer", "recompute", "memory_gib", "fits",
                "tight", "bubble_fraction", "comm_bytes", "parameters"} <= set(r)
        assert r["tp"] * r["pp"] * r["dp"] == 4 and r["recompute"] in ("none", "selective", "full")
        assert r["vpp"] is None or r["vpp"] > 1
        assert set(r["memory_gib"]) == parts and set(r["comm_bytes"]) == {"tp", "pp", "dp", "embedding", "ep", "edp", "cp"}
        assert (r["ep"], r["edp"], r["comm_bytes"]["ep"], r["comm_bytes"]["edp"]) == (1, r["dp"], 0, 0)  # dense
        assert r["parameters"]["total"] == r["parameters"]["active"]
        assert isinstance(r["fits"], bool) and 0.0 <= r["bubble_fraction"] < 1.0
        # the default headroom: 4 of the 80 GiB stay free for what the formulas leave out
        assert r["fits"] == (r["memory_gib"]["total"] <= 76)
        assert r["tight"] == (76 < r["memory_gib"]["total"] <= 80)
    verdicts = [0 if r["fits"] else 1 if r["tight"] else 2 for r in records]
    assert verdicts == sorted(verdicts)  # ranked: fitting, then tight, then the rest
    assert table.returncode == 0 and "layouts shown" in table.stdout
    assert table.stdout.splitlines()[0] == ("plan: model=gpt_1.3b (24 layers x 2048) precision=bf16 seq_length=2048 "
                                            "micro_batch_size=1 global_batch_size=16 world_size=4")
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "format" in bad.stderr
    assert nope.returncode == 1 and nope.stderr.strip().count("\n") == 0
    assert nope.stderr.startswith("error: model=nope: In 'plan': Could not find 'model/nope'; Available options")


@pytest.mark.parametrize("overrides,expected", [
    (["precision=fp8", "precision.fp8_first_last_layers_bf16=2"],
     ["warning: precision=fp8 with no FP8 GEMM: precision.fp8_first_last_layers_bf16=2 keeps all 4 layers bf16; "
      "set it to at most 1, or use precision=bf16"]),
    (["precision=fp8", "precision.fp8_first_last_layers_bf16=1"], []),  # layers 1, 2 compute in FP8
    (["precision=bf16", "precision.fp8_first_last_layers_bf16=2"], []),
])
def test_plan_warns_as_the_trainer_would(overrides, expected):
    from mptrain.plan import plan_warnings

    assert plan_warnings(_cfg(["model=tiny", "world_size=1", *overrides])) == expected


def test_an_moe_plan_says_what_its_formulas_leave_out():
    from mptrain.planner.memory import MOE_ASSUMPTION

    records = _plan(["model=moe_tiny", "world_size=2"])
    assert records and all(MOE_ASSUMPTION in r["assumptions"] for r in records)
    assert {r["sequence_parallel"] for r in records if r["tp"] == 2} == {True}  # the trainer's rule: tp needs SP
    assert not any(MOE_ASSUMPTION in r["assumptions"] for r in _plan(["model=tiny", "world_size=2"]))


def test_the_search_splits_the_experts_and_counts_the_token_dispatch():
    """moe_tiny (4 MoE layers, E 4, top-2, h 64, s 64) on 4 ranks: every ep dividing E and the world is searched; the
    dispatch sends each micro-batch's T·k rows through every MoE layer 4 times (dispatch and combine, forward and
    backward), (ep - 1)/ep of them to other ranks; the expert grads reduce over expert-DP."""
    from mptrain.plan import format_table, parameters_line

    args = ["model=moe_tiny", "precision=bf16", "world_size=4", "train.micro_batch_size=2", "train.global_batch_size=8"]
    records = _plan(args)
    assert {(r["tp"], r["ep"], r["edp"]) for r in records if r["pp"] == 1} == {
        (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)}  # etp = tp: edp = 4 / (tp·ep)
    plain = {r["ep"]: r for r in records if (r["tp"], r["pp"], r["recompute"], r["use_distributed_optimizer"]) ==
             (1, 1, "none", False)}
    rows = 64 * 2 * 2  # s·b·k: one micro-batch (8 / (2·dp 4)) of each rank
    for ep, r in plain.items():
        assert r["comm_bytes"]["ep"] == 4 * 4 * rows * 64 * 2 * (ep - 1) / ep  # layers, passes, rows, h, bf16
    experts = 4 * 4 * 3 * 64 * 64  # layers × E × SwiGLU fc1 [2f, h] + fc2 [h, f], f = h = 64
    # the expert grads of a rank: E/ep experts, all-reduced over edp = 4/ep ranks; the dense rest over dp 4
    assert plain[2]["comm_bytes"]["edp"] == 2 * (1 / 2) * experts / 2 * 4
    assert plain[4]["comm_bytes"]["edp"] == 0
    weights = {ep: r["memory_gib"]["weights"] * 2**30 / 2 for ep, r in plain.items()}  # bf16 elements
    assert weights[1] - weights[2] == weights[2] - weights[4] + experts / 4 == experts / 2
    gathered = {r["ep"]: r for r in _plan([*args, "model.moe_token_dispatcher_type=allgather"])
                if (r["tp"], r["pp"], r["recompute"], r["use_distributed_optimizer"]) == (1, 1, "none", False)}
    # every rank gathers the group's 128 tokens and reduce-scatters them back, plus the forward's probs and map
    assert gathered[4]["comm_bytes"]["ep"] == 4 * (4 * 3 * 128 * 64 * 2 + 3 * 128 * 4 * 5)
    assert parameters_line(records) == ("parameters: 332,416 total, 234,112 active per token (router, top-k experts, "
                                        "shared expert: what FLOPs and MFU count)")
    assert records[0]["parameters"]["total"] - records[0]["parameters"]["active"] == experts / 2  # 2 of 4 unused
    assert format_table(records, gpu_memory_gib=80).splitlines()[1].split()[6:8] == ["ep", "zero"]


def test_plan_searches_the_configured_zero3_beside_ddp_and_zero1():
    """parallel.data_parallel_sharding_strategy=optim_grads_params with HSDP shard 2: the search adds ZeRO-3
    layouts to DDP / ZeRO-1 ones; at dp 4 a rank holds half of every part (its shard group's), no main params,
    and sends per micro-batch the two gathers (bf16) and the fp32 reduce-scatter over 2 ranks plus the fp32
    shards' all-reduce over the 2 replicas."""
    records = _plan(["model=tiny", "precision=bf16", "world_size=4", "train.global_batch_size=8",
                     "train.micro_batch_size=2", f"{SHARDING}=optim_grads_params", "parallel.data_parallel_shard_size=2"])
    one = {r["data_parallel_sharding_strategy"]: r for r in records
           if (r["tp"], r["pp"], r["recompute"]) == (1, 1, "none")}
    assert set(one) == {"no_shard", "optim", "optim_grads_params"}
    z3, ddp = one["optim_grads_params"], one["no_shard"]
    assert (z3["data_parallel_shard_size"], ddp["data_parallel_shard_size"]) == (2, None)
    assert not z3["use_distributed_optimizer"] and not z3["optimizer_cpu_offload"]
    zm, dm = z3["memory_gib"], ddp["memory_gib"]
    n = dm["weights"] * 2**30 / 2  # bf16 elements of a rank
    assert zm["weights"] == dm["weights"] and zm["grads"] == dm["grads"] / 2  # fp32 halves: 4N/2 vs 2N, 4N/2 vs 4N
    assert zm["optimizer_state"] == dm["optimizer_state"] / 2 and zm["main_params"] == 0
    assert zm["gathered"] > 0 == dm["gathered"]
    assert zm["total"] == pytest.approx(zm["weights"] + zm["grads"] + zm["optimizer_state"] + zm["gathered"]
                                        + zm["activations"] + zm["logits"])
    # one micro-batch a rank: (2 gathers × 2 bytes + 4) × N × 1/2 + 2 × 1/2 × 4N / 2
    assert z3["comm_bytes"]["dp"] == pytest.approx(6 * n)
    # at tp 2 the DP group is 2 ranks, the configured shard size: plain ZeRO-3
    assert {r["data_parallel_shard_size"] for r in records if r["tp"] == 2 and r["data_parallel_sharding_strategy"]
            == "optim_grads_params"} == {2}


def test_check_dry_run_on_meta_matches_planner():
    from mptrain.check import format_report, run_check

    cfg = _cfg(["model=tiny", "parallel=tp1pp2", "precision=bf16", "world_size=2"])
    facts = run_check(cfg, 2, mp_context=forkserver())
    assert [f["layers"] for f in facts] == [[0, 1], [2, 3]]
    assert [f["pp"] for f in facts] == [0, 1]
    text, worst = format_report(cfg, facts)
    assert worst < 1e-9 and "worst" in text  # no DP padding at dp 1: exact
    for f in facts:
        assert f["measured"]["num_params"] == f["planned_num_params"]
    # ZeRO-3 at dp 2 on meta: FSDP's local shards (half of each tensor here) are what the planner counts
    cfg = _cfg(["model=tiny", "precision=bf16", "world_size=2", f"{SHARDING}=optim_grads_params"])
    facts = run_check(cfg, 2, mp_context=forkserver())
    text, worst = format_report(cfg, facts)
    assert worst < 1e-9, text
    assert [f["measured"]["weights"] for f in facts] == [2 * f["measured"]["numel"] for f in facts]  # 4 bytes / 2


@pytest.mark.parametrize("capacity, padded, ep, rows", [
    (None, False, 1, 256),  # dropless: T·k = 128 tokens × 2
    (0.5, False, 1, 128),  # each of the 4 experts keeps at most ceil(256/4 · 0.5) = 32 rows
    (2.0, False, 1, 256),  # a capacity above the load: every row
    (0.5, True, 1, 128),  # padded to capacity: exactly 4 × 32 rows
    (2.0, True, 1, 512),  # padded: 4 × min(128, T) rows, most of them padding
    (2.0, True, 2, 256),  # the expert-parallel dispatchers do not pad: the capacity bound
])
def test_routed_rows_follow_the_capacity(capacity, padded, ep, rows):
    from types import SimpleNamespace

    from mptrain.config.model import ModelConfig
    from mptrain.planner.moe import routed_rows

    model = ModelConfig(seq_length=64, num_moe_experts=4, moe_router_topk=2, moe_expert_capacity_factor=capacity,
                        moe_pad_expert_input_to_capacity=padded)
    cfg = SimpleNamespace(model=model, train=SimpleNamespace(micro_batch_size=2))
    assert routed_rows(cfg, tp=1, ep=ep, etp=1) == rows  # s 64 × b 2 = 128 tokens a rank, top-2 of 4 experts


def _check_rank(rank, world, cfg, vocab_size):
    from mptrain.check import dry_run_rank
    from mptrain.training.validate import validate_config

    return dry_run_rank(rank, world, cfg, validate_config(cfg, world), vocab_size)


def test_check_plans_the_experts_of_an_expert_parallel_rank():
    """ep2 on 2 ranks under ZeRO-1: each rank holds 2 of the 4 experts, whose main params are not sharded (expert-DP
    is 1) while the dense ones are over DP 2; check's measured objects equal the plan."""
    from mptrain.check import format_report
    from mptrain.data.tokenizers import build_tokenizer, check_vocab_size

    cfg = _cfg(["model=moe_tiny", "parallel.expert_model_parallel_size=2", "parallel.use_distributed_optimizer=true",
                "precision=bf16", "world_size=2", "train.micro_batch_size=2", "train.global_batch_size=8"])
    vocab = check_vocab_size(cfg.model.vocab_size, build_tokenizer(cfg.data).vocab_size)
    facts = run_distributed(_check_rank, 2, cfg, vocab)  # check's own rank step, on the pool's processes
    text, worst = format_report(cfg, facts)
    assert worst < 0.02, text  # the ZeRO-1 pieces' bucket padding: under check's 2 %
    experts = 4 * 2 * 3 * 64 * 64  # layers × 2 local experts × SwiGLU fc1 + fc2
    for f in facts:
        assert f["measured"]["num_params"] == f["planned_num_params"]
        dense = f["measured"]["numel"] - experts
        assert f["planned"]["main_params"] == 4 * (dense / 2 + experts)


def test_a_layout_within_the_headroom_is_tight_not_fitting():
    """The planned total leaves `hardware.memory_headroom_gib` free to fit (the CUDA context, NCCL buffers and the
    allocator's fragmentation are not in the formulas); one that fits the GPU only inside it is `tight`."""
    from mptrain.plan import format_table

    args = ["model=gpt_1.3b", "precision=bf16", "world_size=2", "train.micro_batch_size=1", "train.global_batch_size=8"]
    smallest = min(r["memory_gib"]["total"] for r in _plan([*args, "hardware.memory_headroom_gib=0"]))
    gpu = smallest + 1.0  # the smallest layout fits the GPU by 1 GiB: inside a 2 GiB headroom
    records = _plan([*args, f"hardware.gpu_memory_gib={gpu}", "hardware.memory_headroom_gib=2"])
    tight = [r for r in records if r["memory_gib"]["total"] == smallest]
    assert tight and all(r["tight"] and not r["fits"] for r in tight)
    assert not any(r["fits"] for r in records)
    assert records[0]["tight"]  # ranked before the layouts that do not fit at all
    roomy = _plan([*args, f"hardware.gpu_memory_gib={gpu}", "hardware.memory_headroom_gib=0.5"])
    assert [r["fits"] for r in roomy if r["memory_gib"]["total"] == smallest] == [True] * len(tight)
    table = format_table(records, top=3, gpu_memory_gib=gpu, memory_headroom_gib=2)
    assert "hardware.memory_headroom_gib=2 free to fit" in table
    assert table.splitlines()[3].split("|")[1].split()[-1] == "tight"  # the first row's fits column
    assert f"(0 fit, {sum(r['tight'] for r in records)} tight)" in table


def test_fit_verdict():
    from mptrain.planner.config import HardwareConfig
    from mptrain.planner.layouts import fit_verdict

    hw = HardwareConfig(gpu_memory_gib=80.0, memory_headroom_gib=4.0)
    assert [fit_verdict(t, hw) for t in (46.85, 76.0, 76.01, 79.6, 80.0, 80.01)] == [
        "yes", "yes", "tight", "tight", "tight", "no"]
    assert HardwareConfig().memory_headroom_gib == 4.0  # the documented default: 5 % of an 80 GiB H100


@pytest.mark.parametrize("layers, label", [
    ([0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23], "0..7, 16..23 (16)"),  # an interleaved stage
    ([2, 3], "2..3 (2)"), ([5], "5 (1)"), ([0, 2, 3], "0, 2..3 (3)"), ([], "-"),
])
def test_check_labels_a_stage_by_its_layer_ranges(layers, label):
    from mptrain.check import layer_ranges

    assert layer_ranges(layers) == label


def test_check_report_says_what_it_measured_and_plans_the_rest():
    """CPU: weights / grads / main params are measured from the meta objects; optimizer state, activations and
    logits are planned only, and the report says so; the interleaved stage lists its chunks' layer ranges."""
    from mptrain.check import MEASURED_PARTS, format_report, run_check

    cfg = _cfg(["model=tiny", "model.num_layers=8", "parallel=tp1pp2", "parallel.virtual_pipeline_model_parallel_size=2",
                "precision=bf16", "world_size=2", "train.micro_batch_size=1", "train.global_batch_size=8"])
    facts = run_check(cfg, 2, mp_context=forkserver())
    text, worst = format_report(cfg, facts)
    lines = text.splitlines()
    assert worst < 1e-9
    assert lines[1] == MEASURED_PARTS
    assert "planned only: optimizer state (Adam creates it at the first step), activations and logits" in lines[1]
    assert [line.split()[4:7] for line in lines[3:5]] == [["0..1,", "4..5", "(4)"], ["2..3,", "6..7", "(4)"]]
    busiest = max(facts, key=lambda f: f["planned_gib"]["total"])
    assert lines[6] == (f"planned peak: {busiest['planned_gib']['total']:.3f} GiB (rank {busiest['rank']}) of "
                        "hardware.gpu_memory_gib=80, leaving hardware.memory_headroom_gib=4 free: fits")
    assert lines[7] == ("activations: planned only (no CUDA device here); on a GPU machine `python -m mptrain.check` "
                        "measures one micro-batch's forward + backward")
    for f in facts:  # the planned parts are the planner's for the same stage
        assert f["planned_gib"]["activations"] > 0 and f["planned_gib"]["total"] > f["planned_gib"]["activations"]
    measured = {"layers": 2, "measured": 1.05 * 2**30, "saved": 0.9 * 2**30, "planned": 2**30}
    cuda_line = format_report(cfg, facts, measured)[0].splitlines()[7]
    assert cuda_line == ("activations per transformer layer, one micro-batch (s=64, b=1, tp 1, 2 vs 4 layers, "
                         "measured on CUDA): kept for the backward measured 0.900 / planned 1.000 GiB (-10.0 %); "
                         "peak of forward + backward above the weights 1.050 GiB")
    failed = format_report(cfg, facts, {"error": "torch.OutOfMemoryError: CUDA out of memory."})[0].splitlines()[7]
    assert failed == "activations: planned only (measuring them on CUDA failed: torch.OutOfMemoryError: CUDA out of memory.)"


def test_planned_activations_of_the_measured_cut_are_the_planners_per_layer():
    """What `check` compares the CUDA measurement with: the difference of the 4- and 2-layer cuts, per layer, is
    the planner's one layer at tp 1 (one micro-batch in flight)."""
    from mptrain.check import measured_layer_counts, one_gpu_layout, planned_activation_bytes
    from mptrain.planner.layouts import layout_config
    from mptrain.planner.memory import layer_activation_bytes

    cfg = _cfg(["model=gpt_125m", "precision=bf16", "world_size=8", "parallel=tp2pp2", "model.seq_length=1024",
                "train.micro_batch_size=2"])
    k, k2 = measured_layer_counts(cfg)
    assert (k, k2) == (2, 4)
    per_layer = (planned_activation_bytes(cfg, num_layers=k2, vocab_size=50257)
                 - planned_activation_bytes(cfg, num_layers=k, vocab_size=50257)) / k
    layout = one_gpu_layout(cfg)
    assert per_layer == pytest.approx(layer_activation_bytes(layout_config(cfg, layout), layout))
    # bf16 at tp 1, GELU f = 4h: norms 4 + QKV/fc1 inputs 4 + S 24 bytes per s·b·h element, + the fp32 logsumexp
    assert per_layer == pytest.approx(1024 * 2 * 768 * 32 + 4 * 12 * 1024 * 2)
    full = _cfg(["model=gpt_125m", "precision=bf16", "world_size=8", "model.recompute_granularity=full",
                 "model.recompute_method=uniform", "model.recompute_num_layers=2"])
    assert measured_layer_counts(full) == (4, 8)  # whole recompute groups


def _fake_cuda_measure(rank, world, cfg, vocab_size):
    """`cuda_activation_peak_bytes` on CPU with CUDA's memory counters stubbed: the build, the forward and backward
    and the freed weight grads run as on a GPU; the counters give known numbers."""
    from unittest import mock

    import torch

    from mptrain.groups import build_groups
    from mptrain.layers import gpt
    from mptrain.planner import measure

    allocated = iter([1000, 1600])  # before the forward, after it
    grads_left = []
    real_backward = torch.Tensor.backward

    def backward(loss, *a, **k):
        real_backward(loss, *a, **k)
        grads_left.extend(p for p in params if p.grad is not None)

    params, built_layers = [], []
    real_build = gpt.build_model_chunks  # `cuda_activation_peak_bytes` imports it when called: the patch holds

    def build(*a, **k):
        chunks = real_build(*a, **k)
        params.extend(chunks[0].parameters())
        built_layers.append(len(chunks[0].decoder.layers))
        return chunks

    groups = build_groups(1, 1)
    try:
        with mock.patch.multiple(torch.cuda, synchronize=lambda *a: None, reset_peak_memory_stats=lambda *a: None,
                                 memory_allocated=lambda *a: next(allocated), max_memory_allocated=lambda *a: 5000,
                                 empty_cache=lambda: None), \
                mock.patch.object(gpt, "build_model_chunks", build), mock.patch.object(torch.Tensor, "backward", backward):
            out = measure.cuda_activation_peak_bytes(cfg, groups, vocab_size=vocab_size, num_layers=2)
    finally:
        groups.destroy()
    return out, built_layers, len(grads_left)


def test_the_cuda_activation_measurement_runs_its_micro_batch():
    """The CUDA path's own code on CPU (the counters stubbed): it builds the cut model, runs one micro-batch forward
    and backward, frees every weight grad as it is made, and reports the counters above the baseline."""
    from mptrain.check import one_gpu_config

    cfg = _cfg(["model=tiny", "precision=bf16", "world_size=4", "parallel=tp1pp2", "train.micro_batch_size=2",
                "parallel.decoder_first_pipeline_num_layers=1"])  # the cut is one stage, whatever the layout
    (out, built_layers, grads_left), = run_distributed(_fake_cuda_measure, 1, one_gpu_config(cfg), 128)
    assert out == {"peak": 4000, "saved": 600}
    assert built_layers == [2] and grads_left == 0  # the cut: 2 layers on one stage; no weight grad kept


def test_check_counts_the_fp8_weight_casts_as_the_planner():
    """precision=fp8: the dry run holds the trainer's FP8 weight casts (fc1 alone passes the size rule here, on
    its TP shard of 528 rows: data and its transpose, 1 byte each), and the planner counts the same bytes."""
    pytest.importorskip("torchao.float8")
    from mptrain.check import format_report, run_check

    cfg = _cfg(["model=tiny", "parallel=tp2pp1", "precision=fp8", "model.ffn_hidden_size=1056", "world_size=2"])
    facts = run_check(cfg, 2, mp_context=forkserver())
    text, worst = format_report(cfg, facts)
    assert worst < 1e-9, text
    h, layers = cfg.model.hidden_size, cfg.model.num_layers
    for f in facts:  # bf16 params (2 bytes an element) + the casts
        assert f["measured"]["weights"] == 2 * f["measured"]["numel"] + layers * 2 * 528 * h


@pytest.mark.parametrize("override, line", [
    ("top=-1", "top=-1 must be >= 1 (rows of the table), or top=null for all of them"),
    ("hardware.gpu_memory_gib=-1", "hardware.gpu_memory_gib=-1.0 must be > 0"),
    ("hardware.assumed_mfu=1.5", "hardware.assumed_mfu=1.5 must be in (0, 1] and hardware.gpus_per_node=8 >= 1"),
    ("+hardware.gpu_memry_gib=80", "hardware.gpu_memry_gib: unknown config key (misspelt? `+` adds keys the schema does "
                                   "not have); did you mean hardware.gpu_memory_gib? valid keys of hardware: assumed_mfu, "
                                   "gpu_memory_gib, gpus_per_node, inter_node_gb_per_s, intra_node_gb_per_s, "
                                   "memory_headroom_gib, peak_tflops"),
    ("hardware.memory_headroom_gib=80", "hardware.memory_headroom_gib=80.0 must be >= 0 and less than "
                                        "hardware.gpu_memory_gib=80.0"),
    ("hardware.memory_headroom_gib=-1", "hardware.memory_headroom_gib=-1.0 must be >= 0 and less than "
                                        "hardware.gpu_memory_gib=80.0"),
    ("+precision.fp8_recipee=rowwise", "precision.fp8_recipee: mptrain.precision.optimizer.FP32Optimizer takes no "
                                       "keyword 'fp8_recipee'; it accepts: fold_into_fused_step, log_num_zeros; did you mean "
                                       "precision.fp8_recipe? remove the key (~precision.fp8_recipee where a preset "
                                       "sets it) or fix its name"),
])
def test_bad_plan_numbers_are_one_line(override, line):
    from mptrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _plan(["model=tiny", "world_size=2", override])
    assert str(err.value) == line


@pytest.mark.parametrize("override, line", [
    ("+foo=1", "error: foo: unknown config key (misspelt? `+` adds keys the schema does not have); valid keys of the top "
               "level: checkpoint, data, debug, format, hardware, logger, loss_scaler, model, optim, parallel, precision, "
               "run, schedule, top, train, world_size"),
    ("world_size=0", "error: world_size=0 must be >= 1"),
])
def test_check_refuses_bad_keys_in_one_line(override, line):
    """`python -m mptrain.check ...`: the one line `train.py` / `plan` print, exit 1, before any process spawns."""
    out = run_python(["-m", "mptrain.check", override, "model=tiny"] +
                     (["world_size=1"] if not override.startswith("world_size") else []), timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert out.stderr.splitlines() == [line]


@pytest.mark.parametrize("command", ["plan", "check"])
@pytest.mark.parametrize("overrides, line", [
    (["precision=fp8", "precision.fp8_recipe=rowwize"],
     "precision.fp8_recipe: unknown option 'rowwize'; valid: tensorwise, rowwise, rowwise_with_gw_hp; set "
     "precision.fp8_recipe to one of them"),
    (["precision=fp16", "loss_scaler=none"],
     "loss_scaler: precision=fp16 with loss_scaler=none (_target_=mptrain.precision.scaler.no_loss_scaler) would "
     "underflow small fp16 gradients to zero; use loss_scaler=auto (dynamic) or loss_scaler=dynamic or "
     "loss_scaler=constant"),
    (["optim.lr=-1"], "optim.lr=-1.0 must be >= 0; set optim.lr to the peak learning rate, e.g. 3e-4"),
])
def test_a_wrong_key_is_reported_as_itself_not_as_the_batch_arithmetic(command, overrides, line):
    """The default batch sizes (2 × dp 8 > 8) fail at tp1pp1 of world_size=8, which plan skips and check runs:
    a key no layout changes is checked first, once, and named (not `train.global_batch_size=8 is not divisible`)."""
    from mptrain.check import run_check
    from mptrain.errors import ConfigError

    args = ["model=tiny", "world_size=8", "parallel=tp1pp1", *overrides]
    with pytest.raises(ConfigError) as err:
        _plan(args) if command == "plan" else run_check(_cfg(args), 8)
    assert str(err.value) == line
    with pytest.raises(ConfigError, match="^train.global_batch_size=8 is not divisible"):  # the real problem stays
        run_check(_cfg(args[:3]), 8)


def test_check_names_world_size_as_the_fix_of_the_world_size():
    """`mptrain.check` takes the world size as `world_size=`, not torchrun's --nproc_per_node: its fix says so."""
    from mptrain.check import run_check
    from mptrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        run_check(_cfg(["model=tiny", "world_size=2", "parallel=tp2pp2"]), 2)
    assert str(err.value) == ("parallel: world size 2 is not divisible by tensor_model_parallel_size × "
                              "pipeline_model_parallel_size = 4; run with world_size=4 or 8, or pick another parallel=")


def test_offload_with_gradient_accumulation_plans_the_unsharded_grads_on_the_device():
    """optim.optimizer_cpu_offload at dp 1: one micro-batch a step keeps no full grad on the device; four keep the
    grads unsharded in fp32 there across the step (`mptrain.distributed.fsdp`): ZeRO-2 adds exactly 4 bytes a param
    (the offloaded fp32 grads' size), ZeRO-3 the same less the one unit's grad it already counted."""
    def gathered(strategy, gbs):
        records = _plan(["model=tiny", "precision=bf16", "world_size=1", f"train.global_batch_size={gbs}",
                         "train.micro_batch_size=2", f"{SHARDING}={strategy}", "optim.optimizer_cpu_offload=true"])
        r = next(r for r in records if r["recompute"] == "none" and r["optimizer_cpu_offload"])
        return r["memory_gib"]["gathered"] * 2**30, r["memory_gib"]["grads"] * 2**30

    (z2_one, grads), (z2_four, _) = gathered("optim_grads", 2), gathered("optim_grads", 8)
    assert z2_four - z2_one == grads > 0
    z3_one, z3_four = gathered("optim_grads_params", 2)[0], gathered("optim_grads_params", 8)[0]
    assert 0 < z3_four - z3_one < grads


def test_offloaded_layouts_rank_after_those_that_fit_without_and_say_what_their_step_time_leaves_out():
    from mptrain.planner.memory import OFFLOAD_ASSUMPTION

    records = _plan(["model=tiny", "precision=bf16", "world_size=2", "train.global_batch_size=8", "train.micro_batch_size=2",
                     f"{SHARDING}=optim_grads_params", "optim.optimizer_cpu_offload=true"])
    offloaded = [r["optimizer_cpu_offload"] for r in records if r["fits"]]
    assert offloaded == sorted(offloaded) and offloaded[0] is False and offloaded[-1] is True
    assert all((OFFLOAD_ASSUMPTION in r["assumptions"]) == r["optimizer_cpu_offload"] for r in records)
