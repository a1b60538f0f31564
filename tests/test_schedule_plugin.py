"""A user's pipeline schedule plugged in from the command line (`schedule._target_=...`), and bad targets.

examples/plugins/mptrain_plugins/schedules.py is a user's GPipe written against the public
interface (`ScheduleSpec`, `forward_step` / `backward_step`, `p2p`); it must equal the built-in
``schedule=gpipe`` bitwise (same operations in the same order): losses, grad norms and every
parameter after two steps, at tp1pp4 and tp2pp2 (4 gloo ranks each, through `run(cfg)`).
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from harness import run_distributed
from mptrain.training.validate import validate_config
from mptrain.errors import ConfigError
from mptrain.checkpoint.offline import load_full_state
from procs import run_python
from train_utils import compose, read_rows, run_job

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "mptrain_plugins.schedules.my_gpipe"
STEPS = 2  # the first step, and one after an update: every parameter after two updates, bitwise
BASE = ["model=tiny", f"train.train_iters={STEPS}", "train.eval_interval=null", "train.global_batch_size=8",
        "train.micro_batch_size=2", f"checkpoint.save_interval={STEPS}"]


def wrong_signature(spec, *, model):
    """A target lacking the per-call keywords (used as `schedule._target_=test_schedule_plugin.wrong_signature`)."""
    raise AssertionError("never called")


def _train(tmp: Path, name: str, overrides: list):
    run_dir = tmp / name
    run_distributed(run_job, 4, BASE + overrides + [f"run.dir={run_dir}", f"checkpoint.save={run_dir}/ckpt"],
                    timeout_s=300)
    layout = json.loads((run_dir / "layout.json").read_text())
    params, _ = load_full_state(str(run_dir / "ckpt"))
    return read_rows(run_dir), params, {r["schedule"] for r in layout["ranks"]}


@pytest.mark.parametrize("parallel", ["tp1pp4", "tp2pp2"])
def test_user_gpipe_equals_builtin_gpipe_bitwise(tmp_path, parallel):
    rows, params, names = _train(tmp_path, "builtin", [f"parallel={parallel}", "schedule=gpipe"])
    urows, uparams, unames = _train(tmp_path, "user", [f"parallel={parallel}", f"schedule._target_={PLUGIN}"])
    assert names == {"gpipe"} and unames == {PLUGIN}  # layout.json names what ran
    assert len(rows) == STEPS
    pick = ("iteration", "lm_loss", "grad_norm")
    assert [[r[k] for k in pick] for r in urows] == [[r[k] for k in pick] for r in rows]  # bitwise: == on floats
    assert params.keys() == uparams.keys() and len(params) > 0
    for name, p in params.items():
        assert torch.equal(p, uparams[name]), name


@pytest.mark.parametrize("overrides, world, message", [
    (["schedule._target_=no_such_pkg.forward_backward"], 1, "schedule._target_=no_such_pkg.forward_backward does not import"),
    (["schedule._target_=mptrain_plugins.schedules.no_such_fn"], 1,
     "schedule._target_=mptrain_plugins.schedules.no_such_fn: module mptrain_plugins.schedules has no no_such_fn"),
    (["schedule._target_=mptrain.schedules.interface.CALL_KEYWORDS"], 1,
     "schedule._target_=mptrain.schedules.interface.CALL_KEYWORDS is not callable"),
    (["schedule._target_=test_schedule_plugin.wrong_signature"], 1,
     "schedule._target_=test_schedule_plugin.wrong_signature is not a pipeline schedule: it takes no keyword "
     "forward_step_func, data_iterator, forward_only, loss_scale, no_sync_func, stats"),
    ([f"schedule._target_={PLUGIN}", "+schedule.chunks=2"], 1,
     f"schedule.chunks: {PLUGIN} takes no keyword 'chunks'"),
    (["parallel=tp1pp2vpp2", f"schedule._target_={PLUGIN}"], 2,  # the plugin's own check_layout
     "parallel.virtual_pipeline_model_parallel_size=2: mptrain_plugins.schedules.my_gpipe runs one model chunk"),
    (["schedule.name=gpipe"], 1, "schedule.name: unknown option 'gpipe' for schedule._target_=mptrain.schedules.auto"),
])
def test_bad_schedule_target_is_one_config_error(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate_config(compose(overrides), world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cfg_job_shows_the_target_and_a_bad_one_exits_1(tmp_path):
    env = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}:{ROOT / 'examples' / 'plugins'}", "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}
    train = [str(ROOT / "train.py")]
    shown = run_python([*train, "--cfg", "job", "schedule=1f1b"], cwd=tmp_path, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["schedule"]["_target_"] == "mptrain.schedules.one_f_one_b.forward_backward_1f1b"
    bad = run_python([*train, "schedule._target_=no_such_pkg.fn", f"run.dir={tmp_path}/r"], cwd=tmp_path, env=env,
                     timeout=120)
    assert bad.returncode == 1
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "schedule._target_=no_such_pkg.fn does not import" in lines[0], bad.stderr
    assert not (tmp_path / "r").exists()  # nothing written before validation passes
