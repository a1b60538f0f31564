"""An override Hydra cannot compose, or an interpolation that does not resolve, is one line on stderr,
printed once, exit 1 (DESIGN.md §5)."""

import os
import shutil
import signal
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mptrain import errors
from mptrain.config.cli import FIX, compose_error, exit_on_compose_error
from mptrain.config.schema import register
from mptrain.config.schema import as_config
from mptrain.errors import ConfigError
from harness import run_distributed
from procs import run_python

CONF = Path(__file__).resolve().parents[1] / "conf"
MODELS = ", ".join(sorted(p.stem for p in (CONF / "model").glob("*.yaml")))  # not the schema's base_model

register()


@pytest.fixture(autouse=True)
def _launch_free_env(monkeypatch):
    """No launcher or Hydra variable of the developer's shell decides what these tests see."""
    for key in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("argv, message", [
    (["train.manual_gc=yes_please"], f"train.manual_gc=yes_please: Value 'yes_please' is not a valid bool (type str); {FIX}"),
    (["parallel=tp2pp2", "optim.lr=abc"], f"optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float; {FIX}"),
    (["train.nosuch_key=3"], f"Could not override 'train.nosuch_key': Key 'nosuch_key' not in 'TrainConfig'; {FIX}"),
    (["model=nosuch"], f"model=nosuch: In 'config': Could not find 'model/nosuch'; Available options in 'model': {MODELS}"),
    (["data.split=969,30,1"], "data.split=969,30,1: a comma makes a sweep; write data.split=[969,30,1] for a list, "
                              "\"data.split='969,30,1'\" for a string (the shell keeps the inner quotes), or add -m to sweep "
                              "over the values"),
    (["model=tiny", "logger.run_name=a=b"], "'logger.run_name=a=b': mismatched input '=' expecting <EOF>; quote a value "
                                            "with special characters (\"key='...'\"), see https://hydra.cc/docs/1.2/"
                                            "advanced/override_grammar/basic"),
    (["model=tiny", "experiment=null"], f"experiment=null: Config group override must be a string or a list. Got NoneType; {FIX}"),
    (["+optim=adamw"], "+optim=adamw: optim is selected already; select another option with optim=adamw (no +)"),
    (["train.seed=range(1,3)"], "Sweep parameters 'train.seed=range(1,3)' requires --multirun"),
])
def test_composition_errors_are_one_line_naming_the_key(argv, message):
    assert compose_error(argv, str(CONF)) == message


@pytest.mark.parametrize("argv, pointer", [
    (["train.train_iter=5"], "Could not override 'train.train_iter': Key 'train_iter' not in 'TrainConfig'; "
                             "did you mean train.train_iters?"),
    (["model.hiden_size=64"], "Could not override 'model.hiden_size': Key 'hiden_size' not in 'ModelConfig'; "
                              "did you mean model.hidden_size?"),
    (["trian.train_iters=5"], "Could not override 'trian.train_iters': Key 'trian' not in 'Config'; "
                              "did you mean train.train_iters?"),  # the group misspelt: the rest of the key kept
    # Megatron-LM's names: the same name in its group, or the closest spelling
    (["num_layers=4"], "Could not override 'num_layers': Key 'num_layers' not in 'Config'; did you mean model.num_layers?"),
    (["micro_batch_size=2"], "Could not override 'micro_batch_size': Key 'micro_batch_size' not in 'Config'; "
                             "did you mean train.micro_batch_size?"),
    (["optim.lr_warmup_sample=8"], "Could not override 'optim.lr_warmup_sample': Key 'lr_warmup_sample' not "
                                   "in 'OptimConfig'; did you mean optim.lr_warmup_samples?"),
    (["model=tiny", "train.lr=3e-4"], "Could not override 'train.lr': Key 'lr' not in 'TrainConfig'; did you mean optim.lr?"),
    (["optim.seed=3"], "Could not override 'optim.seed': Key 'seed' not in 'OptimConfig'; did you mean data.seed or train.seed?"),
])
def test_an_unknown_key_names_the_closest_known_key(argv, pointer):
    assert compose_error(argv, str(CONF)) == f"{pointer} {FIX}"


def test_a_sweep_is_checked_as_its_first_job():
    """-m: a misspelt key is one line before the sweep starts (each swept key at its first value); a sweep
    that composes is left to Hydra."""
    argv = ["-m", "parallel=tp2pp2,tp1pp4", "train.train_iter=5"]
    assert compose_error(argv, str(CONF)) == (
        "Could not override 'train.train_iter': Key 'train_iter' not in 'TrainConfig'; did you mean "
        f"train.train_iters? {FIX}")
    assert compose_error(["-m", "optim.lr=abc"], str(CONF)) == (
        f"optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float; {FIX}")  # every job would fail
    assert compose_error(["-m", "parallel=tp2pp2,tp1pp4", "train.seed=range(1,3)"], str(CONF)) is None
    assert compose_error(["--multirun", "parallel=tp2pp2,tp9pp9"], str(CONF)) is None  # the second job fails alone


@pytest.mark.parametrize("argv, line", [
    (["--num-layers", "4"], "--num-layers 4: not an option of python train.py, which takes key=value overrides; "
                            f"write model.num_layers=4; {FIX}"),
    (["model=tiny", "--micro-batch-size=2", "--sequence-parallel", "train.seed=1"],
     "--micro-batch-size=2 --sequence-parallel: not options of python train.py, which takes key=value overrides; "
     f"write train.micro_batch_size=2 parallel.sequence_parallel=true; {FIX}"),
    (["--lr-warmup-init", "0.01", "--no-such-thing"],
     "--lr-warmup-init 0.01 --no-such-thing: not options of python train.py, which takes key=value overrides; "
     f"the closest key to --lr-warmup-init is optim.lr_warmup_iters; no key is close to --no-such-thing; {FIX}"),
    (["-m", "--cfg", "job", "--tensor-model-parallel-size", "2"],  # beside Hydra's own flags
     "--tensor-model-parallel-size 2: not an option of python train.py, which takes key=value overrides; "
     f"write parallel.tensor_model_parallel_size=2; {FIX}"),
])
def test_megatron_style_flags_name_the_overrides_they_mean(argv, line):
    assert compose_error(argv, str(CONF)) == line


def test_train_py_answers_a_megatron_flag_in_one_line(tmp_path):
    proc = run_python([str(CONF.parent / "train.py"), "--num-layers", "4", "model=tiny"], cwd=tmp_path,
                      env=dict(os.environ), timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: --num-layers 4: not an option of python train.py, which takes key=value overrides; "
        f"write model.num_layers=4; {FIX}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    [], ["experiment=shakespeare_cpu", "train.train_iters=40", "train.eval_interval=null"],
    ["parallel=tp2pp4", "precision=fp16", "model=gpt_2.7b", "optim.lr=3e-4", "optim._target_=torch.optim.RMSprop"],
    ["--cfg", "job", "optim.lr=abc"], ["hydra.run.dir=/tmp/x", "optim.lr=abc"],  # Hydra's own handling
    ["--multi", "--config-name=config", "optim.lr=1e-3,3e-4"],  # Hydra's flags, one abbreviated (argparse takes it)
])
def test_composable_or_hydras_own_command_lines_pass(argv):
    assert compose_error(argv, str(CONF)) is None


def test_hydra_full_error_leaves_the_error_to_hydra(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    assert compose_error(["optim.lr=abc"], str(CONF)) is None


def test_train_py_prints_the_line_alone_and_writes_nothing(tmp_path):
    proc = run_python([str(CONF.parent / "train.py"), "optim.lr=abc", f"run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                      env=dict(os.environ), timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"error: optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float; {FIX}"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank_key, world_key", [("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")])
def test_only_rank_0_prints_and_every_rank_exits_1(monkeypatch, capsys, rank_key, world_key):
    slept = []
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the grace's SIGTERM handler: not in pytest
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    lines = {}
    for rank in (0, 1):
        monkeypatch.setenv(rank_key, str(rank))
        monkeypatch.setenv(world_key, "2")
        with pytest.raises(SystemExit) as exit_info:
            exit_on_compose_error(str(CONF), ["model=nosuch"])
        assert exit_info.value.code == 1
        lines[rank] = capsys.readouterr().err.splitlines()
    assert lines == {0: [f"error: model=nosuch: In 'config': Could not find 'model/nosuch'; Available options in 'model': {MODELS}"],
                     1: []}
    assert slept == [5.0]  # rank 1 waits for rank 0's line; rank 0 exits once it has printed


@pytest.mark.parametrize("override, message", [
    ("logger.run_name=${nosuch.key}", "logger.run_name: Interpolation key 'nosuch.key' not found"),
    ("train.seed=${oc.env:MPTRAIN_TEST_UNSET}",
     "train.seed: KeyError raised while resolving interpolation: \"Environment variable 'MPTRAIN_TEST_UNSET' not found\""),
])
def test_an_interpolation_that_does_not_resolve_is_one_config_error(override, message, monkeypatch):
    monkeypatch.delenv("MPTRAIN_TEST_UNSET", raising=False)
    assert compose_error([override], str(CONF)) is None  # it composes: resolution happens when the job reads it
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[override])
    with pytest.raises(ConfigError) as info:
        as_config(cfg)
    assert str(info.value) == f"{message}; fix the ${{...}} interpolation (or write a literal $ as \\$)"


def test_a_config_error_is_reported_when_the_launch_environment_is_the_error(monkeypatch, capsys):
    from mptrain.training import run as run_module

    def unreadable():
        raise ConfigError("SLURM_JOB_NODELIST='node[01-02]': neither submitit nor scontrol is available")

    monkeypatch.setattr(run_module, "read_dist_env", unreadable)
    with pytest.raises(SystemExit) as exit_info:
        run_module.exit_on_config_error(ConfigError("train.seed=-1 must be >= 0"))
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "error: train.seed=-1 must be >= 0\n"  # not a traceback of the second error


@pytest.mark.parametrize("rank, local_rank, prints", [(0, 0, True), (1, 1, False), (2, 0, True), (3, 1, False)])
def test_this_machines_error_is_printed_by_each_nodes_first_rank(monkeypatch, capsys, rank, local_rank, prints):
    """torchao / the GPU / a checkpoint folder (``per_node``): alike on a node's ranks, not across nodes: local
    rank 0 of each node prints it (world 4 = 2 nodes x 2); the others exit 1 after the grace period, silent."""
    from mptrain.groups import DistEnv
    from mptrain.training import run as run_module

    monkeypatch.setattr(run_module, "read_dist_env", lambda: DistEnv(rank=rank, world_size=4, local_rank=local_rank))
    monkeypatch.setattr("mptrain.errors.time.sleep", lambda s: None)  # the grace period, and its SIGTERM handler
    monkeypatch.setattr("mptrain.errors.signal.signal", lambda *a: None)
    err = ConfigError("precision=fp8 needs torchao 0.18.0, found 0.12.0")
    err.per_node = True
    with pytest.raises(SystemExit) as exit_info:
        run_module.exit_on_config_error(err)
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == ("error: precision=fp8 needs torchao 0.18.0, found 0.12.0\n" if prints else "")


def test_a_sweep_under_a_config_that_sets_multirun_is_left_to_hydra(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "lr_sweep.yaml").write_text("# @package _global_\nhydra:\n  mode: MULTIRUN\n")
    assert compose_error(["experiment=lr_sweep", "optim.lr=1e-3,3e-4"], str(conf)) is None  # @hydra.main sweeps it
    assert compose_error(["optim.lr=1e-3,3e-4"], str(conf)).startswith("optim.lr=1e-3,3e-4: a comma makes a sweep")


def test_a_config_tree_that_does_not_compose_blames_no_override(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "config.yaml").write_text((conf / "config.yaml").read_text() + "\ntrain: [not, a, mapping\n")
    message = compose_error(["optim.lr=1e-3"], str(conf))
    assert message is not None and not message.startswith("optim.lr") and FIX not in message


def _first_to_say_task(rank, world, tag):
    import torch.distributed as dist

    from mptrain.errors import _first_to_say

    line = f"error: the same line on every rank ({tag})"
    store = dist.distributed_c10d._get_default_store()
    timeout = store.timeout
    without = _first_to_say(line)  # a store a worker hosts (it may be gone with that worker): every rank prints
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as under torchrun, whose agent hosts the store
    try:
        dist.barrier()
        same = _first_to_say(line)
        own = _first_to_say(f"error: rank {rank}'s own line ({tag})")
        dist.barrier()
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # a restarted job's attempt reports it again
        again = _first_to_say(line)
    finally:
        del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
        os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
    assert store.timeout == timeout  # the store's own timeout is left as it was (a sweep's next job uses it)
    return without, same, own, again


def test_a_line_several_ranks_report_is_printed_once():
    """Errors that need not be alike on every rank (raised while building, after the process group is up):
    each distinct line is printed by the first rank to report it, counted in the job's store."""
    import uuid

    results = run_distributed(_first_to_say_task, 2, uuid.uuid4().hex)
    without, same, own, again = zip(*results)
    assert without == (True, True) and own == (True, True)
    assert sorted(same) == [False, True] and sorted(again) == [False, True]


def test_the_fix_names_the_program_that_was_run():
    """plan / check compose `conf/plan.yaml`: their fix is their own `--cfg job`, not train.py's."""
    from mptrain.config.cli import fix_for
    from mptrain.planner.config import CONF_DIR, register_plan

    register_plan()
    message = compose_error(["optim.lr=abc"], str(CONF_DIR), "plan", "python -m mptrain.plan")
    assert message == ("optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float; "
                       "`python -m mptrain.plan --cfg job` lists every key and its value")
    assert fix_for("python train.py") == FIX


def test_the_world_size_fix_names_the_launchers_flag(tmp_path, monkeypatch):
    """A layout the world size does not divide: the fix names torchrun's --nproc_per_node, or the variable `make
    train` sets the world size with (the Makefile's recipe passes MPTRAIN_WORLD_SIZE_FLAG=NPROC)."""
    from mptrain.training.run import _validated
    from train_utils import compose

    cfg = compose(["model=tiny", "parallel=tp2pp2", f"run.dir={tmp_path}/run"])
    fix = "run with {}=4 or 8, or pick another parallel="
    monkeypatch.delenv("MPTRAIN_WORLD_SIZE_FLAG", raising=False)
    with pytest.raises(ConfigError) as info:
        _validated(cfg, 2)
    assert str(info.value).endswith(fix.format("--nproc_per_node")), info.value
    recipe = (CONF.parent / "Makefile").read_text().split("\ntrain: ")[1].split("\n\n")[0]
    assert "MPTRAIN_WORLD_SIZE_FLAG=NPROC " in recipe and "--nproc_per_node=$(NPROC)" in recipe
    monkeypatch.setenv("MPTRAIN_WORLD_SIZE_FLAG", "NPROC")
    with pytest.raises(ConfigError) as info:
        _validated(cfg, 2)
    assert str(info.value).endswith(fix.format("NPROC")), info.value
    assert not (tmp_path / "run").exists()
