"""optim.decoupled_lr / decoupled_min_lr (Megatron's --decoupled-lr / --decoupled-min-lr): the input embedding and
the output layer in param groups of their own, driven by the schedule over [decoupled_min_lr, decoupled_lr].

- the LR of every group after every step equals Megatron-core's ``OptimizerParamScheduler.get_lr(param_group)``
  (written out below from megatron/core/optimizer_param_scheduler.py), for every decay style;
- in a real model (tp1pp2, ZeRO-1 at dp2, untied at dp2) the decoupled groups hold exactly the word embedding and the
  output layer's weight (the tied copy on the last stage), read back from the optimizer;
- a tp1pp2 run equals tp1pp1 with decoupled LR on (DESIGN.md §3 tolerances), and the option changes the run;
- ZeRO-1 at dp2 with decoupled LR resumes bitwise; the schedule's state holds the two keys;
- the rules: one ConfigError line each.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed
from mptrain.errors import ConfigError
from mptrain.layers.sharding import ShardSpec
from mptrain.optim import EMBEDDING_OR_OUTPUT, OptimizerParamScheduler, param_groups
from mptrain.training.validate import validate_config
from train_utils import compose, read_rows, run_job, without_timing


def megatron_lr(n: int, *, max_lr: float, min_lr: float, warmup: int, decay: int, style: str, wsd_iters: int = 0,
                wsd_style: str = "exponential", init_lr: float = 0.0) -> float:
    """Megatron-core's ``OptimizerParamScheduler.get_lr(param_group)`` for a group with ``max_lr`` / ``min_lr``,
    after ``n`` steps (megatron/core/optimizer_param_scheduler.py, as written there)."""
    if warmup > 0 and n <= warmup:
        return init_lr + ((max_lr - init_lr) * float(n) / float(warmup))
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        warmup_steps, num_steps = max(warmup, 1), max(n, 1)
        return max(min_lr, max_lr * warmup_steps**0.5 / (num_steps**0.5))
    decay_ratio = float(n - warmup) / float(decay - warmup)
    delta_lr = max_lr - min_lr
    if style == "linear":
        coeff = 1.0 - decay_ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    else:  # WSD
        anneal_start = decay - wsd_iters
        if n <= anneal_start:
            coeff = 1.0
        else:
            wsd_ratio = float(n - anneal_start) / float(wsd_iters)
            coeff = {"linear": 1.0 - wsd_ratio, "cosine": 0.5 * (math.cos(math.pi * wsd_ratio) + 1.0),
                     "exponential": (2.0 * math.pow(0.5, wsd_ratio)) - 1.0,
                     "minus_sqrt": 1.0 - math.sqrt(wsd_ratio)}[wsd_style]
    return min_lr + coeff * delta_lr


def _specs_and_params():
    """A weight, a bias, the word embedding and the output layer's weight."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (6, 2, 8, 8)]
    specs = [ShardSpec((6,)), ShardSpec((2,), no_weight_decay=True), ShardSpec((8,), embedding_or_output=True),
             ShardSpec((8,), embedding_or_output=True, tied_embedding=True, is_shared_copy=True)]
    return params, specs


def test_param_groups_put_the_embedding_and_output_layer_apart():
    params, specs = _specs_and_params()
    groups = param_groups(params, specs, 0.1)
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(params[0])], [id(params[1])],
                                                             [id(params[2]), id(params[3])], []]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.1, 0.0]
    assert [g.get(EMBEDDING_OR_OUTPUT, False) for g in groups] == [False, False, True, True]
    # without such params: the two groups as before (no empty marked groups)
    assert len(param_groups(params[:2], specs[:2])) == 2


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
@pytest.mark.parametrize("decoupled_min_lr", [0.02, None])
def test_every_group_follows_megatrons_formula(style, decoupled_min_lr):
    params, specs = _specs_and_params()
    opt = torch.optim.SGD(param_groups(params, specs), lr=0.5)
    sched = OptimizerParamScheduler(opt, lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10,
                                    lr_decay_style=style, lr_wsd_decay_iters=4 if style == "WSD" else None,
                                    decoupled_lr=3.0, decoupled_min_lr=decoupled_min_lr)
    low = 0.1 if decoupled_min_lr is None else decoupled_min_lr  # Megatron: decoupled_min_lr defaults to min_lr
    shape = dict(warmup=2, decay=10, style=style, wsd_iters=4)
    for n in range(13):
        if n:
            assert sched.step() == megatron_lr(n, max_lr=1.0, min_lr=0.1, **shape)  # what metrics.jsonl's lr shows
        got = [g["lr"] for g in opt.param_groups]  # read back from the optimizer
        want_default = megatron_lr(n, max_lr=1.0, min_lr=0.1, **shape)
        want_decoupled = megatron_lr(n, max_lr=3.0, min_lr=low, **shape)
        assert got == [want_default, want_default, want_decoupled, want_decoupled], (n, got)
    if style in ("linear", "cosine", "WSD"):
        assert opt.param_groups[3]["lr"] == low  # past the decay: the decoupled floor


def test_schedule_state_holds_the_decoupled_lr():
    params, specs = _specs_and_params()
    kwargs = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10, lr_decay_style="cosine", decoupled_lr=3.0)
    sched = OptimizerParamScheduler(torch.optim.SGD(param_groups(params, specs), lr=0.5), **kwargs)
    for _ in range(4):
        sched.step()
    state = sched.state_dict()
    assert (state["decoupled_lr"], state["decoupled_min_lr"], state["num_steps"]) == (3.0, None, 4)
    opt = torch.optim.SGD(param_groups(params, specs), lr=0.5)
    resumed = OptimizerParamScheduler(opt, **kwargs)
    resumed.load_state_dict(state)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in sched.optimizer.param_groups]
    # a checkpoint written before the keys existed: loads, its position restored
    resumed.load_state_dict({k: v for k, v in state.items() if not k.startswith("decoupled")})
    assert resumed.num_steps == 4 and opt.param_groups[2]["lr"] == megatron_lr(4, max_lr=3.0, min_lr=0.1, warmup=2,
                                                                               decay=10, style="cosine")


SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.eval_interval=null",
         "train.global_batch_size=8", "train.micro_batch_size=2", "model.vocab_size=100", "data.vocab_size=100",
         "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.lr_warmup_iters=1", "optim.lr_decay_iters=6",
         "optim.lr_decay_style=cosine"]
DECOUPLED = ["optim.decoupled_lr=2e-2", "optim.decoupled_min_lr=2e-3"]


@pytest.mark.parametrize("overrides, message", [
    (["optim.decoupled_min_lr=1e-3"], "optim.decoupled_min_lr=0.001 has no effect without optim.decoupled_lr"),
    (["optim.decoupled_lr=1e-3", "optim.decoupled_min_lr=2e-3"], "optim.decoupled_min_lr=0.002 must be <= optim.decoupled_lr=0.001"),
    (["optim.decoupled_lr=1e-5"], r"optim.min_lr=0.0001 \(the embedding and output layer's final LR while "
                                  r"optim.decoupled_min_lr is null\) must be <= optim.decoupled_lr=1e-05"),
    (["optim.decoupled_lr=-1"], "optim.decoupled_lr=-1.0 and optim.decoupled_min_lr=None must be >= 0"),
    (["optim.decoupled_lr=1e-2", "optim.lr_scheduler._target_=mptrain_plugins.lr_schedules.CosineWithRestarts",
      "+optim.lr_scheduler.cycle_iters=4"], "optim.decoupled_lr=0.01: optim.lr_scheduler._target_=mptrain_plugins"),
])
def test_rules_are_one_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose(SMALL + overrides), 1)


def _groups_of_a_real_model(rank, world, overrides: list, steps: int) -> list:
    """[(param names, marked, [group lr after 0..steps schedule steps])] of this rank's optimizer, as `run` builds it."""
    from mptrain.config.schema import as_config
    from mptrain.groups import build_groups
    from mptrain.training.run import build_model_and_optimizer

    cfg = as_config(compose(overrides))
    derived = validate_config(cfg, world)
    groups = build_groups(derived.tensor_model_parallel_size, derived.pipeline_model_parallel_size)
    try:
        chunks, optimizer, sched, _, _ = build_model_and_optimizer(cfg, groups, derived, vocab_size=100)
        names = {id(p): n for c in chunks for n, p in c.module.named_parameters()}
        model_param = {id(e.main): e.model_param for e in optimizer.entries}
        lrs = [[g["lr"] for g in optimizer.param_groups]]
        for _ in range(steps):
            sched.step()
            lrs.append([g["lr"] for g in optimizer.param_groups])
        return [(sorted(names[id(model_param[id(p)])] for p in g["params"]), bool(g.get(EMBEDDING_OR_OUTPUT)),
                 [row[i] for row in lrs]) for i, g in enumerate(optimizer.param_groups)]
    finally:
        groups.destroy()


@pytest.mark.parametrize("layout", ["parallel=tp1pp2", "parallel.use_distributed_optimizer=true",
                                    "model.untie_embeddings_and_output_weights=true"])
def test_real_model_groups_and_their_lr(layout):
    got = run_distributed(_groups_of_a_real_model, 2, SMALL + DECOUPLED + [layout], 8)
    shape = dict(warmup=1, decay=6, style="cosine")
    default = [megatron_lr(n, max_lr=1e-3, min_lr=1e-4, **shape) for n in range(9)]
    decoupled = [megatron_lr(n, max_lr=2e-2, min_lr=2e-3, **shape) for n in range(9)]
    marked = {rank: sorted(n for names, m, _ in groups if m for n in names) for rank, groups in enumerate(got)}
    if layout == "parallel=tp1pp2":  # the embedding on the first stage, its tied copy (the output layer) on the last
        assert marked == {0: ["embedding.word_embeddings.weight"], 1: ["output_layer.weight"]}
    elif layout.startswith("model.untie"):  # dp2: the embedding and the output layer's own weight, on each rank
        assert marked == {r: ["embedding.word_embeddings.weight", "output_layer.weight"] for r in (0, 1)}
    else:  # ZeRO-1: each DP rank steps its piece of the tied embedding, in the decoupled group
        assert marked == {0: ["embedding.word_embeddings.weight"], 1: ["embedding.word_embeddings.weight"]}
    for groups in got:
        assert any(not m and names for names, m, _ in groups)
        for names, m, lrs in groups:
            assert lrs == (decoupled if m else default), names


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_tp1pp2_equals_tp1pp1_with_decoupled_lr(tmp_path):
    common = SMALL + DECOUPLED + ["train.train_iters=6"]
    runs = {}
    for name, world, overrides in (("pp1", 1, common + ["parallel=tp1pp1"]), ("pp2", 2, common + ["parallel=tp1pp2"]),
                                   ("off", 1, SMALL + ["train.train_iters=6", "parallel=tp1pp1"])):
        run_distributed(run_job, world, overrides + [f"run.dir={tmp_path / name}"])
        runs[name] = read_rows(tmp_path / name)
    for want, got in zip(runs["pp1"], runs["pp2"]):
        # DESIGN.md §3: loss rel 1e-5, grad norm rel 1e-4 across layouts (the fp32 reduction order differs)
        assert _rel(got["lm_loss"], want["lm_loss"]) < 1e-5 and _rel(got["grad_norm"], want["grad_norm"]) < 1e-4
        assert got["lr"] == want["lr"]
    # the decoupled LR (20x lr on the tied embedding) really moved the run: iteration 3 on differs well beyond that
    assert all(_rel(a["lm_loss"], b["lm_loss"]) > 1e-3 for a, b in zip(runs["pp1"][2:], runs["off"][2:]))
    assert [r["lr"] for r in runs["pp1"]] == [r["lr"] for r in runs["off"]]  # metrics' lr: the other params'


def test_zero1_dp2_with_decoupled_lr_resumes_bitwise(tmp_path):
    from mptrain.checkpoint.offline import load_full_state

    common = SMALL + DECOUPLED + ["train.train_iters=6", "parallel.use_distributed_optimizer=true"]
    # the straight run saves after iteration 3 and goes on; the resume of that checkpoint trains 4 to 6 (a stop by
    # train.exit_interval and its resume: tests/test_checkpoint_resume.py)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_distributed(run_job, 2, common + [f"run.dir={straight}", f"checkpoint.save={tmp_path / 'ck_straight'}",
                                          "checkpoint.save_interval=3"])
    ckpt = tmp_path / "ck_resumed"
    run_distributed(run_job, 2, common + [f"run.dir={resumed}", f"checkpoint.load={tmp_path / 'ck_straight'}",
                                          "checkpoint.load_iteration=3", f"checkpoint.save={ckpt}"])
    rows = without_timing(read_rows(resumed))
    assert [r["iteration"] for r in rows] == [4, 5, 6]
    assert rows == without_timing(read_rows(straight))[3:]  # bitwise: == on the JSON floats
    for fp32_master in (False, True):  # the model weights and ZeRO-1's fp32 main params, bitwise
        want, _ = load_full_state(str(tmp_path / "ck_straight"), fp32_master=fp32_master)
        got, _ = load_full_state(str(ckpt), fp32_master=fp32_master)
        assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
