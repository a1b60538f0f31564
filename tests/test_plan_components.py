"""The planner reads the components from their `_target_`s: the optimizer-state estimate from
``optim._target_`` and the in-flight micro-batches from the resolved schedule; a user class is
assumed (Adam's 2 states, GPipe's m in flight) and the plan output says so. In-process, tiny model."""

from __future__ import annotations

import pytest

from mptrain.planner.config import compose_plan

TINY = ["model=tiny", "precision=fp32", "train.micro_batch_size=1", "train.global_batch_size=4"]


def _plan(overrides):
    from mptrain.plan import plan_from_config

    return plan_from_config(compose_plan(TINY + list(overrides)))[1]


def _by_layout(records):
    return {(r["tp"], r["pp"], r["vpp"], r["dp"], r["use_distributed_optimizer"], r["recompute"], r["sequence_parallel"]): r
            for r in records}


@pytest.mark.parametrize("optim, states, note", [
    (["optim=adam"], 2, None),
    (["optim=adamw"], 2, None),
    (["optim=sgd"], 0, None),
    (["optim=sgd", "optim.sgd_momentum=0.9"], 1, None),
    (["optim=adam", "optim._target_=torch.optim.SGD", "+optim.momentum=0.9"], 1, None),  # the target decides, not the label
    (["optim=sgd", "optim._target_=torch.optim.AdamW"], 2, None),
    (["optim._target_=torch.optim.RMSprop"], 2,
     "optimizer state: optim._target_=torch.optim.RMSprop is not Adam/AdamW/SGD; assumed 2 fp32 states per parameter "
     "element (as Adam)"),
])
def test_optimizer_state_is_read_from_the_target(optim, states, note):
    records = _plan(["world_size=1", *optim])
    for r in records:  # fp32, no ZeRO-1 at world size 1: weights are 4 bytes per element, each state 4 more
        assert r["memory_gib"]["optimizer_state"] == pytest.approx(states * r["memory_gib"]["weights"], rel=1e-12)
        assert r["assumptions"] == ([note] if note else [])


def test_check_report_says_what_it_assumed():
    from omegaconf import OmegaConf

    from mptrain.check import format_report

    zeros = {"weights": 0, "grads": 0, "main_params": 0, "optimizer_state": 0, "num_params": 0}
    parts = {"weights": 0.0, "grads": 0.0, "main_params": 0.0, "optimizer_state": 0.0, "activations": 0.0,
             "logits": 0.0, "optimizer_workspace": 0.0, "total": 0.0}
    fact = {"rank": 0, "tp": 0, "pp": 0, "dp": 0, "layers": [0], "measured": zeros, "planned": zeros, "planned_gib": parts}
    for optim, assumed in ((["optim=adamw"], False), (["optim._target_=torch.optim.RMSprop"], True)):
        text, _ = format_report(OmegaConf.to_object(compose_plan(TINY + optim)), [fact])
        assert text.endswith("assumed: optimizer state: optim._target_=torch.optim.RMSprop is not Adam/AdamW/SGD; "
                             "assumed 2 fp32 states per parameter element (as Adam)") is assumed


def test_user_schedule_is_planned_as_gpipe_and_the_plan_says_so():
    from mptrain.plan import format_table

    user = "mptrain_plugins.schedules.my_gpipe"
    mine = _by_layout(_plan(["world_size=2", f"schedule._target_={user}"]))
    gpipe = _by_layout(_plan(["world_size=2", "schedule=gpipe"]))
    one_f = _by_layout(_plan(["world_size=2", "schedule=1f1b"]))
    note = (f"schedule: {user} has no in-flight formula here; assumed GPipe's (all m micro-batches in flight)")
    piped = [k for k in mine if k[1] == 2]
    assert piped and set(mine) == set(gpipe)  # the user schedule rejects vpp as gpipe does: same layouts
    for key in piped:
        assert mine[key]["schedule"] == user and mine[key]["assumptions"] == [note]
        assert mine[key]["stage_total_gib"] == gpipe[key]["stage_total_gib"]  # m = 4 in flight on both stages
        assert gpipe[key]["assumptions"] == []
        # 1F1B holds fewer on stage 0 (min(pp - r, m) = 2), so the GPipe assumption is the larger estimate
        assert mine[key]["memory_gib"]["activations"] > one_f[key]["memory_gib"]["activations"]
    assert format_table(list(mine.values()), gpu_memory_gib=80).endswith(f"assumed: {note}")
    assert "assumed:" not in format_table(list(gpipe.values()), gpu_memory_gib=80)
