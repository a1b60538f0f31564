"""Mixture of Experts end to end through `mptrain.training.run.run` (gloo pool, CPU, fp32):

- the tiny MoE model trains, metrics.jsonl holds its routing statistics, the kernels: line names the
  experts' GEMMs, and a step reads the host once (the statistics ride in the loss's read);
- pp2, dp2 and tp2 with sequence parallelism (experts sharded over the TP ranks, through either dispatcher, or
  whole on each) compute the tp1pp1 math per step (DESIGN.md §3 tolerances), aux and z losses, expert-bias
  update, shared expert and its gate included;
- full recomputation replays the same routing (input jitter included): every row equals the plain run's;
- resume is bitwise, the expert bias crossing the checkpoint; an ep2 checkpoint resumes at ep1, ep4, tp2 x ep2 and
  pp2 x ep2 and continues as the straight run.
"""

from __future__ import annotations

import pytest

from harness import run_distributed
from train_utils import read_rows, run_job, without_timing

SMALL = ["model=moe_tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16",
         "model.moe_ffn_hidden_size=32", "train.eval_interval=null", "train.global_batch_size=8",
         "train.micro_batch_size=2"]
# everything a step of the MoE layer does: sigmoid routing with the expert bias, aux and z losses, a gated shared expert
FULL = ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
        "model.moe_router_bias_update_rate=0.01", "model.moe_z_loss_coeff=0.001",
        "model.moe_shared_expert_intermediate_size=32", "model.moe_shared_expert_gate=true", "optim.lr=0.01"]
# 2 steps: the first, and one after an update of the weights and of the expert bias (the routing they change);
# checkpoints hold iteration 1 and resume for iteration 2
STEPS = 2
MOE_KEYS = ("moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max",
            "moe_dropped_tokens")


def _run(tmp_path, name: str, world: int, overrides: list, split: str = "train") -> list:
    run_dir = tmp_path / name
    given = {o.split("=")[0] for o in overrides}
    base = [o for o in SMALL if o.split("=")[0] not in given]
    run_distributed(run_job, world, base + overrides + [f"run.dir={run_dir}"], timeout_s=300)
    return read_rows(run_dir, split)


def test_moe_trains_and_logs_its_routing(tmp_path):
    rows = _run(tmp_path, "tp1pp1", 1, ["train.train_iters=5", "optim.lr=0.01", "train.eval_interval=5",
                                        "train.eval_iters=1", "model.moe_z_loss_coeff=0.001",
                                        "model.moe_expert_capacity_factor=1.0"])
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.05
    valid = read_rows(tmp_path / "tp1pp1", "valid")  # evaluation routes too (no aux losses, nothing counted)
    assert [r["iteration"] for r in valid] == [0, 5] and valid[1]["lm_loss"] < valid[0]["lm_loss"]
    tokens = 8 * 16 * 2  # global batch × seq × top-k, per layer and iteration
    for r in rows:
        assert list(r)[-len(MOE_KEYS):] == list(MOE_KEYS)  # after the DESIGN.md keys
        assert 1.0 <= r["moe_aux_loss"] < 1.5  # 1 at perfect balance (coeff-free), larger otherwise
        assert r["moe_z_loss"] > 0
        assert len(r["moe_tokens_per_expert_max"]) == 2  # one entry per MoE layer
        for lo, hi in zip(r["moe_tokens_per_expert_min"], r["moe_tokens_per_expert_max"]):
            assert lo <= tokens / 4 <= hi and lo < hi
        assert 0 <= r["moe_dropped_tokens"] < tokens
    log = (tmp_path / "tp1pp1" / "train.log").read_text()
    assert "experts=grouped_mm" in log and "| moe_aux " in log


def _same(rows, ref, *, loss_rel=1e-5, norm_rel=1e-4):
    assert [r["iteration"] for r in rows] == list(range(1, STEPS + 1))
    for r, q in zip(rows, ref):
        assert r["lm_loss"] == pytest.approx(q["lm_loss"], rel=loss_rel), r["iteration"]
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=norm_rel), r["iteration"]
        assert r["moe_aux_loss"] == pytest.approx(q["moe_aux_loss"], rel=loss_rel), r["iteration"]
        assert r["moe_z_loss"] == pytest.approx(q["moe_z_loss"], rel=loss_rel), r["iteration"]
        # the same tokens chose the same experts (the expert bias moved alike)
        assert r["moe_tokens_per_expert_max"] == q["moe_tokens_per_expert_max"], r["iteration"]
        assert r["moe_tokens_per_expert_min"] == q["moe_tokens_per_expert_min"], r["iteration"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), "tp1pp1", 1, FULL + [f"train.train_iters={STEPS}"])


LAYOUTS_2 = {
    "pp2": ["parallel=tp1pp2"],
    "dp2": ["parallel=tp1pp1"],
    # tp2 with sequence parallelism, each rank routing its sequence shard; the experts sharded over both ranks
    # (etp = tp, the all-to-all or all-gather dispatcher over them), or whole on each (etp = 1, grads summed over TP)
    "tp2_sp_alltoall": ["parallel=tp2pp1", "parallel.sequence_parallel=true"],
    "tp2_sp_allgather": ["parallel=tp2pp1", "parallel.sequence_parallel=true", "model.moe_token_dispatcher_type=allgather"],
    "tp2_sp_etp1": ["parallel=tp2pp1", "parallel.sequence_parallel=true", "parallel.expert_tensor_parallel_size=1"],
    # ZeRO-3: the experts (ep 1: expert-DP is DP) sharded with their layer over the two DP ranks
    "dp2_zero3": ["parallel=tp1pp1", "parallel.data_parallel_sharding_strategy=optim_grads_params"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS_2))
def test_two_rank_layouts_match_tp1pp1(tmp_path, reference, layout):
    rows = _run(tmp_path, layout, 2, FULL + LAYOUTS_2[layout] + [f"train.train_iters={STEPS}"])
    _same(rows, reference)
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]


# expert parallelism: each rank holds 2 of the 4 experts; their grads summed over the expert-data-parallel group
# (edp 1 on world 2, edp 2 on world 4), counted once per expert in the grad norm; the clip is active (FULL's grads
# are above 0.05 at every step)
LAYOUTS_EP = {
    "ep2": (2, ["parallel=tp1pp1", "parallel.expert_model_parallel_size=2", "train.clip_grad=0.05"]),
    "dp2_ep2": (4, ["parallel=tp1pp1", "parallel.expert_model_parallel_size=2", "train.clip_grad=0.05"]),
    "pp2_ep2": (4, ["parallel=tp1pp2", "parallel.expert_model_parallel_size=2", "train.clip_grad=0.05"]),
    "tp2_sp_ep2": (4, ["parallel=tp2pp1", "parallel.sequence_parallel=true", "parallel.expert_model_parallel_size=2",
                       "train.clip_grad=0.05"]),
    # ZeRO-1: the expert weights' optimizer state sharded over expert-DP, the dense weights' over DP
    "dp2_ep2_zero1": (4, ["parallel=tp1pp1", "parallel.expert_model_parallel_size=2", "train.clip_grad=0.05",
                          "parallel.use_distributed_optimizer=true"]),
    # ZeRO-2: the dense weights sharded over DP (4 ranks), each rank's 2 experts over expert-DP (2 ranks)
    "dp2_ep2_zero2": (4, ["parallel=tp1pp1", "parallel.expert_model_parallel_size=2", "train.clip_grad=0.05",
                          "parallel.data_parallel_sharding_strategy=optim_grads"]),
}


@pytest.fixture(scope="module")
def clipped_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), "tp1pp1", 1, FULL + ["train.clip_grad=0.05", f"train.train_iters={STEPS}"])


# the layouts whose run also writes a checkpoint of iteration 1 (and goes on): the resume tests below read it
SAVED = ("ep2", "dp2_ep2_zero1")


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """``get(layout) -> (rows, checkpoint folder or None)``: each `LAYOUTS_EP` run once per module (the layout test
    and the resume tests read the same run; each still runs it when alone)."""
    done = {}

    def get(layout: str):
        if layout not in done:
            world, overrides = LAYOUTS_EP[layout]
            tmp = tmp_path_factory.mktemp(layout)
            ckpt = tmp / "ckpt" if layout in SAVED else None
            save = [f"checkpoint.save={ckpt}", "checkpoint.save_interval=1"] if ckpt else []
            done[layout] = (_run(tmp, layout, world, FULL + overrides + [f"train.train_iters={STEPS}", *save]), ckpt)
        return done[layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS_EP))
def test_expert_parallel_layouts_match_tp1pp1(ep_runs, clipped_reference, layout):
    rows, _ = ep_runs(layout)
    assert [r["iteration"] for r in rows] == [1, 2]
    for r, q in zip(rows, clipped_reference):
        assert q["grad_norm"] > 0.05  # the clip scaled every step
        for key in ("lm_loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
            assert r[key] == pytest.approx(q[key], rel=1e-5), (key, r["iteration"])
        assert r["moe_tokens_per_expert_max"] == q["moe_tokens_per_expert_max"], r["iteration"]


@pytest.mark.parametrize("saved_at", SAVED)
def test_a_checkpoint_written_at_ep2_resumes_at_ep1(tmp_path, clipped_reference, ep_runs, saved_at):
    common = FULL + ["train.clip_grad=0.05", f"train.train_iters={STEPS}"]
    _, ckpt = ep_runs(saved_at)  # world 2 (ep2), or world 4 under ZeRO-1 (dp2 x ep2)
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(ckpt / "iter_0000001")).read_metadata().state_dict_metadata
    fc1 = keys["model/decoder.layers.0.mlp.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (4, 64, 32)  # the global expert axis: each EP rank wrote its 2 experts at its offset
    assert sorted(tuple(c.offsets)[0] for c in fc1.chunks) == [0, 2]
    resumed = _run(tmp_path, "ep1", 1, common + [f"checkpoint.load={ckpt}", "checkpoint.load_iteration=1"])
    assert [r["iteration"] for r in resumed] == [2]
    for key in ("lm_loss", "grad_norm", "moe_aux_loss"):
        assert resumed[0][key] == pytest.approx(clipped_reference[1][key], rel=1e-5), key


@pytest.fixture(scope="module")
def ep2_checkpoint(ep_runs):
    """A checkpoint of iteration 1 written at ep2 (world 2): the ep2 layout's run of the clipped reference's config."""
    return ep_runs("ep2")[1]


# each resumed layout re-cuts the global expert axis: 1 expert a rank (ep4), 2 experts a rank with their FFN split
# over the TP ranks (tp2 x ep2, etp = tp), or the layers split over two stages (pp2 x ep2)
RESUME_LAYOUTS = {
    "ep4": ["parallel=tp1pp1", "parallel.expert_model_parallel_size=4"],
    "tp2_sp_ep2": ["parallel=tp2pp1", "parallel.sequence_parallel=true", "parallel.expert_model_parallel_size=2"],
    "pp2_ep2": ["parallel=tp1pp2", "parallel.expert_model_parallel_size=2"],
}


@pytest.mark.parametrize("layout", list(RESUME_LAYOUTS))
def test_an_ep2_checkpoint_resumes_in_other_expert_layouts(tmp_path, clipped_reference, ep2_checkpoint, layout):
    resumed = _run(tmp_path, layout, 4, FULL + RESUME_LAYOUTS[layout] + [
        "train.clip_grad=0.05", f"train.train_iters={STEPS}", f"checkpoint.load={ep2_checkpoint}",
        "checkpoint.load_iteration=1"])
    assert [r["iteration"] for r in resumed] == [2]
    for key in ("lm_loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        assert resumed[0][key] == pytest.approx(clipped_reference[1][key], rel=1e-5), key
    assert resumed[0]["moe_tokens_per_expert_max"] == clipped_reference[1]["moe_tokens_per_expert_max"]


def test_full_recompute_replays_the_same_routing(tmp_path):
    jitter = FULL + ["model.moe_input_jitter_eps=0.05", "train.train_iters=3"]
    plain = _run(tmp_path, "plain", 1, jitter)
    recomputed = _run(tmp_path, "recompute", 1, jitter + ["model.recompute_granularity=full",
                                                          "model.recompute_method=uniform",
                                                          "model.recompute_num_layers=1"])
    assert without_timing(recomputed) == without_timing(plain)  # bitwise, statistics counted once


def test_resume_is_bitwise_with_the_expert_bias(tmp_path, reference):
    common = FULL + [f"train.train_iters={STEPS}"]
    straight = reference  # the same config on one process
    ckpt = tmp_path / "ckpt"
    _run(tmp_path, "split", 1, common + [f"checkpoint.save={ckpt}", "train.exit_interval=1"])
    resumed = _run(tmp_path, "split", 1, common + [f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}"])
    assert without_timing(resumed) == without_timing(straight)
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(ckpt / "iter_0000001")).read_metadata().state_dict_metadata
    assert "model/decoder.layers.1.mlp.router.expert_bias" in keys


def test_a_dropless_step_reads_the_host_as_a_dense_one(tmp_path, monkeypatch):
    from mptrain.training.run import run
    from train_utils import compose, count_host_reads

    def reads(name: str, model: list) -> int:
        before = sum(calls.values())
        run(compose(model + ["model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.train_iters=2",
                             "train.eval_interval=null", "train.defer_step_read=true", f"run.dir={tmp_path / name}"]))
        return sum(calls.values()) - before

    calls = count_host_reads(monkeypatch)
    dense = reads("dense", ["model=tiny", "model.activation=swiglu", "model.add_bias_linear=false"])
    moe = reads("moe", ["model=moe_tiny", "model.moe_ffn_hidden_size=32"])
    assert moe == dense  # the routing statistics ride in the step's one read; grouped GEMMs need no split sizes
