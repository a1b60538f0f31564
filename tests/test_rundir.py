"""Run folder: default name, existing-folder policy planned before the config resolves, config agreement,
rank 0's claim broadcast (gloo)."""

import copy
import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from harness import run_distributed
from mptrain.config.schema import _SCHEMA_NODE
from mptrain.errors import ConfigError
from mptrain.runs.claim import check_config_agreement, claim_run_dir, config_fingerprint
from mptrain.runs.folder import default_run_dir, planned_config, run_dir_decision
from mptrain.runs.summary import SweepJob


def _cfg(**dotted):
    cfg = copy.deepcopy(_SCHEMA_NODE)  # the structured Config node (a copy: ~45 ms less than building it again)
    for key, value in dotted.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


def _planned(cfg, explicit=True, sweep_job=None):
    """(resolved config, plan) as the trainer plans them; `explicit`: run.dir came from the command line."""
    return planned_config(cfg, sweep_job=sweep_job, explicit=explicit)


def _single(cfg, explicit=True, sweep_job=None):
    """The claimed folder of a world of one."""
    return claim_run_dir(*_planned(cfg, explicit, sweep_job), rank=0, world_size=1)


def _checkpoint(folder: Path) -> str:
    """A folder that `checkpoint.load` resumes from (its `latest`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "latest").write_text("2\n")
    return str(folder)


def test_default_run_dir_is_model_layout_precision():
    """The layout part is the degrees the run uses: a preset overridden key by key names what runs."""
    cfg = _cfg(model__name="gpt_1.3b", parallel__name="tp2pp4", parallel__tensor_model_parallel_size=2,
               parallel__pipeline_model_parallel_size=4, precision__name="bf16")
    assert default_run_dir(cfg) == "outputs/gpt_1.3b-tp2pp4-bf16"
    cfg = _cfg(model__name="tiny", parallel__name="tp1pp1", parallel__tensor_model_parallel_size=2,
               parallel__pipeline_model_parallel_size=2, parallel__virtual_pipeline_model_parallel_size=2,
               precision__name="fp16")
    assert default_run_dir(cfg) == "outputs/tiny-tp2pp2vpp2-fp16"
    cfg = _cfg(model__name="tiny", parallel__tensor_model_parallel_size=2, parallel__expert_model_parallel_size=4,
               parallel__expert_tensor_parallel_size=1, precision__name="bf16")
    assert default_run_dir(cfg) == "outputs/tiny-tp2pp1ep4etp1-bf16"
    cfg = _cfg(model__name="tiny", parallel__tensor_model_parallel_size=2, parallel__expert_tensor_parallel_size=2,
               precision__name="bf16")
    assert default_run_dir(cfg) == "outputs/tiny-tp2pp1-bf16"  # ep 1, etp = tp: the dense layout's name


def test_default_run_dir_created_relative_to_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = _single(_cfg())
    assert run_dir == tmp_path / "outputs" / "tiny-tp1pp1-fp32"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # nothing else written


def test_config_yaml_is_resolved_with_the_run_dir(tmp_path):
    run_dir = _single(_cfg(run__dir=str(tmp_path / "r"), train__train_iters=7))
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run"]["dir"] == str(tmp_path / "r")
    assert saved["train"]["train_iters"] == 7
    assert saved["parallel"]["tensor_model_parallel_size"] == 1


def test_existing_empty_folder_is_used(tmp_path):
    (tmp_path / "r").mkdir()
    assert _single(_cfg(run__dir=str(tmp_path / "r"))) == tmp_path / "r"


def test_existing_run_folder_refused_unless_resuming(tmp_path):
    d = tmp_path / "r"
    cfg = _cfg(run__dir=str(d))
    _single(cfg)
    (d / "metrics.jsonl").write_text('{"split": "train", "iteration": 1}\n')
    with pytest.raises(ConfigError, match=r"run.dir=.*already holds a run \(config.yaml, metrics.jsonl\)") as err:
        _single(cfg)
    assert "\n" not in str(err.value)
    assert _single(_cfg(run__dir=str(d), checkpoint__load=_checkpoint(tmp_path / "ck"))) == d  # appended to: resuming
    assert (d / "metrics.jsonl").read_text() == '{"split": "train", "iteration": 1}\n'


def test_non_run_folder_and_file_refused_even_when_resuming(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    (tmp_path / "afile").write_text("x")
    ck = _checkpoint(tmp_path / "ck")
    for name, text in (("junk", "is not empty (notes.txt, ...) and is not a run folder"), ("afile", "is not a folder")):
        for load in (None, ck):  # fresh, resuming
            with pytest.raises(ConfigError, match=r"run.dir=") as err:
                _single(_cfg(run__dir=str(tmp_path / name), checkpoint__load=load))
            assert text in str(err.value)
    assert run_dir_decision(tmp_path / "missing", resuming=False) is None


def test_sweep_job_folder_under_the_root(tmp_path):
    job = SweepJob(root=str(tmp_path / "S"), subdir="parallel=tp2pp1", num=1, overrides=("parallel=tp2pp1",), swept=("parallel",))
    run_dir = _single(_cfg(run__dir=str(tmp_path / "S")), sweep_job=job)
    assert run_dir == tmp_path / "S" / "parallel=tp2pp1"
    assert (run_dir / "config.yaml").exists()


def test_a_sweep_job_resumes_from_the_checkpoints_in_its_own_folder(tmp_path):
    """`-m ... checkpoint.load=${run.dir}/ck`: the path resolves into the job's folder; a job folder holding a run
    and its checkpoints is appended to (the second half of a sweep split in time)."""
    root, sub = tmp_path / "S", "train.seed=1"
    _hold_run(root / sub)
    _checkpoint(root / sub / "ck")
    job = SweepJob(root=str(root), subdir=sub, num=0, overrides=(sub,), swept=("train.seed",))
    cfg = _cfg(run__dir=str(root))
    cfg.checkpoint.save = cfg.checkpoint.load = "${run.dir}/ck"
    config, plan = _planned(cfg, sweep_job=job)
    assert plan.resuming and config.checkpoint.load == f"{root}/{sub}/ck"
    assert claim_run_dir(config, plan, rank=0, world_size=1) == root / sub
    other = SweepJob(root=str(root), subdir="train.seed=2", num=1, overrides=(), swept=("train.seed",))
    _hold_run(root / "train.seed=2")  # a run without checkpoints: still refused, as before
    with pytest.raises(ConfigError, match="already holds a run"):
        _single(cfg, sweep_job=other)


def test_sweep_job_paths_under_run_dir_are_the_jobs_own(tmp_path):
    """`${run.dir}/checkpoints` resolves into each job's own folder (jobs never share one); other paths stay."""
    root = tmp_path / "S"
    for sub in ("parallel=tp2pp1", "parallel=tp1pp2"):
        job = SweepJob(root=str(root), subdir=sub, num=1, overrides=(sub,), swept=("parallel",))
        cfg = _cfg(run__dir=str(root), checkpoint__load=f"{tmp_path}/x")
        cfg.checkpoint.save = "${run.dir}/checkpoints"
        config, plan = _planned(cfg, sweep_job=job)
        assert claim_run_dir(config, plan, rank=0, world_size=1) == root / sub
        assert (config.run.dir, config.checkpoint.save, config.checkpoint.load) == (
            f"{root}/{sub}", f"{root}/{sub}/checkpoints", f"{tmp_path}/x")
        assert cfg.run.dir == str(root)  # the caller's config is left alone


def test_fingerprint_ignores_run_dir_only():
    a, _ = config_fingerprint(_cfg(run__dir="/a"))
    b, _ = config_fingerprint(_cfg(run__dir="/b"))
    c, _ = config_fingerprint(_cfg(run__dir="/a", optim__lr=0.5))
    assert a == b and a != c


def test_config_mismatch_names_key_and_values():
    fps = [config_fingerprint(_cfg()), config_fingerprint(_cfg()), config_fingerprint(_cfg(train__seed=7))]
    with pytest.raises(ConfigError, match=r"rank 2's resolved config differs from rank 0's at train.seed \(rank 0: 1234, rank 2: 7\)"):
        check_config_agreement(fps)
    check_config_agreement(fps[:2])


def _claim_on_world(rank, world_size, root, seed_on_rank1, taken_after_plan):
    """Every rank plans and claims; returns the path or the ConfigError text (so the test sees every rank's
    outcome). `taken_after_plan`: rank 0 finds the folder holding a run once every rank has planned (another
    run took it meanwhile); the others must learn the verdict from rank 0."""
    import torch.distributed as dist

    seed = seed_on_rank1 if rank == 1 else 1234
    config, plan = _planned(_cfg(run__dir=str(Path(root) / "run"), train__seed=seed))
    dist.barrier()
    if taken_after_plan and rank == 0:
        (Path(root) / "run").mkdir(exist_ok=True)
        (Path(root) / "run" / "train.log").write_text("old\n")
    try:
        return str(claim_run_dir(config, plan, rank=rank, world_size=world_size))
    except ConfigError as e:
        return "ConfigError: " + str(e)


def test_world2_rank0_claims_and_broadcasts(tmp_path):
    out = run_distributed(_claim_on_world, 2, str(tmp_path), 1234, False)
    assert out == [str(tmp_path / "run")] * 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]  # written once, by rank 0


def test_world2_refusal_raised_on_every_rank(tmp_path):
    out = run_distributed(_claim_on_world, 2, str(tmp_path), 1234, True)
    assert out[0] == out[1] and out[0].startswith("ConfigError: run.dir=") and "already holds a run (train.log)" in out[0]


def test_world2_config_mismatch_raised_on_every_rank_before_the_folder(tmp_path):
    out = run_distributed(_claim_on_world, 2, str(tmp_path), 99, False)
    assert out[0] == out[1]
    assert "rank 1's resolved config differs from rank 0's at train.seed (rank 0: 1234, rank 1: 99)" in out[0]
    assert not (tmp_path / "run").exists()


def test_failed_start_then_corrected_start_in_the_same_run_dir(tmp_path):
    """A start that fails after the folder was written (here: the first step raises) leaves config.yaml,
    train.log and an empty metrics.jsonl; the corrected start in the same run.dir reuses the folder."""
    from train_utils import compose, read_rows

    from mptrain.training.run import run

    d = tmp_path / "r"
    base = ["model=tiny", "train.train_iters=2", "train.eval_interval=null", f"run.dir={d}"]
    with pytest.raises(RuntimeError, match="injected failure"):
        run(compose(base + ["debug.fail_rank=0", "debug.fail_iteration=1"]))
    assert sorted(p.name for p in d.iterdir()) == ["config.yaml", "metrics.jsonl", "train.log"]
    run(compose(base))
    assert [r["iteration"] for r in read_rows(d)] == [1, 2]
    assert "debug" in yaml.safe_load((d / "config.yaml").read_text())
    assert yaml.safe_load((d / "config.yaml").read_text())["debug"]["fail_rank"] is None  # the corrected config
    with pytest.raises(ConfigError, match="already holds a run"):  # a run with rows is still protected
        run(compose(base))


def test_resume_at_or_past_train_iters_says_so(tmp_path, capsys):
    """Resuming from a checkpoint at iteration >= train.train_iters: exit 0 (nothing to do) with one line."""
    from train_utils import compose

    from mptrain.training.run import run

    ck = tmp_path / "ck"
    common = ["model=tiny", "train.eval_interval=null", f"checkpoint.save={ck}", f"checkpoint.load={ck}"]
    run(compose(common + ["train.train_iters=2", f"run.dir={tmp_path}/a"]))
    # trained on to 3 without saving: the checkpoint stays at 2, metrics.jsonl holds rows 1-3
    run(compose(["model=tiny", "train.eval_interval=null", f"checkpoint.load={ck}", "train.train_iters=3",
                 f"run.dir={tmp_path}/a"]))
    rows = (tmp_path / "a" / "metrics.jsonl").read_text()
    assert [json.loads(r)["iteration"] for r in rows.splitlines()] == [1, 2, 3]
    run(compose(common + ["train.train_iters=1", f"run.dir={tmp_path}/a"]))
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == rows  # a run that trains nothing deletes no row
    line = f"checkpoint.load={ck} is at iteration 2 >= train.train_iters=1: nothing to train; raise train.train_iters to continue"
    assert line in (tmp_path / "a" / "train.log").read_text().splitlines()


def test_config_yaml_and_checkpoint_meta_keep_keys_added_with_plus(tmp_path):
    """A user target's own keywords (`+optim.alpha`, `+...core_attention.window`) are part of the run: config.yaml
    and the checkpoint's meta record them (generate / export rebuild the model from that config)."""
    from train_utils import compose

    from mptrain.training.run import run

    core = "model.transformer_layer.submodules.self_attention.submodules.core_attention"
    run(compose(["model=tiny", "train.train_iters=1", "train.eval_interval=null", "optim._target_=torch.optim.RMSprop",
                 "+optim.alpha=0.95", f"{core}._target_=mptrain_plugins.attention.SlidingWindowAttention",
                 f"+{core}.window=16", f"checkpoint.save={tmp_path}/ck", f"run.dir={tmp_path}/r"]))
    for saved in (yaml.safe_load((tmp_path / "r" / "config.yaml").read_text()),
                  json.loads((tmp_path / "ck" / "iter_0000001" / "meta.json").read_text())["config"]):
        assert saved["optim"]["alpha"] == 0.95
        node = saved["model"]["transformer_layer"]["submodules"]["self_attention"]["submodules"]["core_attention"]
        assert node["window"] == 16


def _hold_run(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text("x: 1\n")
    (path / "metrics.jsonl").write_text('{"split": "train", "iteration": 1}\n')


def test_configured_folder_holding_a_run_gives_way_to_the_first_free_suffix(tmp_path, capsys):
    """run.dir named by the config (not the command line): a fresh run moves to <dir>-2, then <dir>-3; one
    line on stderr names the folder; a `${run.dir}/...` path moves with it; the folder's run is untouched."""
    d = tmp_path / "r"
    _hold_run(d)
    cfg = _cfg(run__dir=str(d))
    cfg.checkpoint.save = "${run.dir}/checkpoints"
    config, plan = _planned(cfg, explicit=False)
    assert config.run.dir == str(tmp_path / "r-2") and config.checkpoint.save == f"{tmp_path}/r-2/checkpoints"
    assert capsys.readouterr().err == ""  # planned: nothing said, nothing written until the run claims the folder
    assert not (tmp_path / "r-2").exists()
    assert claim_run_dir(config, plan, rank=0, world_size=1) == tmp_path / "r-2"
    assert capsys.readouterr().err == (f"run.dir: {d} already holds a run; this run writes to {tmp_path}/r-2 "
                                       "(pick the folder with run.dir=, or resume with checkpoint.load=)\n")
    assert (d / "metrics.jsonl").read_text() == '{"split": "train", "iteration": 1}\n'
    assert sorted(p.name for p in d.iterdir()) == ["config.yaml", "metrics.jsonl"]
    saved = yaml.safe_load((tmp_path / "r-2" / "config.yaml").read_text())
    assert saved["run"]["dir"] == str(tmp_path / "r-2") and saved["checkpoint"]["save"] == f"{tmp_path}/r-2/checkpoints"
    (tmp_path / "r-2" / "metrics.jsonl").write_text('{"split": "train", "iteration": 1}\n')
    (tmp_path / "r-3").mkdir()
    (tmp_path / "r-3" / "notes.txt").write_text("x")  # not a run folder: skipped, never written to
    assert _single(_cfg(run__dir=str(d)), explicit=False) == tmp_path / "r-4"
    assert sorted(p.name for p in (tmp_path / "r-3").iterdir()) == ["notes.txt"]


def test_a_save_folder_inside_run_dir_is_judged_where_it_lands(tmp_path, capsys, monkeypatch):
    """checkpoint.save under run.dir resolves into the planned folder: the old run's unusable folder does not
    refuse the new run, and the save folder is checked where it lands (by the plan; the trainer's checkpoint
    checks leave a save folder inside run.dir to it)."""
    from mptrain.checkpoint import atomic
    from mptrain.training.run import _check_checkpoint_paths

    d = tmp_path / "r"
    _hold_run(d)
    (d / "checkpoints").write_text("not a folder")  # the old run's: no save could write under it
    cfg = _cfg(run__dir=str(d))
    cfg.checkpoint.save = "${run.dir}/checkpoints/sub"
    config, _ = _planned(cfg, explicit=False)
    _check_checkpoint_paths(config)  # inside run.dir: the plan's to judge
    assert config.checkpoint.save == f"{tmp_path}/r-2/checkpoints/sub"
    assert atomic.save_refusal(str(d / "checkpoints" / "sub")) is not None  # where it was, it would be refused
    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)  # where it lands, this user cannot write
    cfg = _cfg(run__dir=str(tmp_path / "new"))
    cfg.checkpoint.save = "${run.dir}/checkpoints"
    with pytest.raises(ConfigError) as err:
        _single(cfg, explicit=False)
    assert str(err.value) == (f"checkpoint.save={tmp_path}/new/checkpoints: {tmp_path} is not writable by this user; "
                              "fix its permissions or point checkpoint.save= elsewhere")
    assert not (tmp_path / "new").exists()  # refused before the folder was created


def test_a_literal_path_under_the_configured_folder_stays_and_is_never_overwritten(tmp_path):
    """Only `${run.dir}` follows the planned folder: a path typed out stays as given, so a save folder holding the
    old run's checkpoints is refused (the trainer's checkpoint checks), not written over or silently moved."""
    from mptrain.checkpoint.atomic import iter_dir_name
    from mptrain.training.run import _check_checkpoint_paths

    d = tmp_path / "r"
    _hold_run(d)
    (d / "ck" / iter_dir_name(8)).mkdir(parents=True)
    (d / "ck" / "latest").write_text("8\n")
    config, plan = _planned(_cfg(run__dir=str(d), checkpoint__save=f"{d}/ck"), explicit=False)
    assert (plan.dir, config.checkpoint.save) == (str(tmp_path / "r-2"), f"{d}/ck")
    with pytest.raises(ConfigError, match=rf"checkpoint.save={d}/ck already holds checkpoints \(latest = iteration 8\)"):
        _check_checkpoint_paths(config)


def test_configured_folder_is_resumed_only_from_its_own_checkpoints(tmp_path, capsys):
    """A resume appends to the configured folder when it loads that folder's checkpoints; loading
    another run's checkpoints makes a fresh run, which gives way to <dir>-2 like any other, and the line
    says how to append to that run instead."""
    d = tmp_path / "r"
    _hold_run(d)
    own, other = _checkpoint(d / "checkpoints"), _checkpoint(tmp_path / "other" / "checkpoints")
    assert _single(_cfg(run__dir=str(d), checkpoint__load=own), explicit=False) == d
    capsys.readouterr()
    rows = (d / "metrics.jsonl").read_text()
    assert _single(_cfg(run__dir=str(d), checkpoint__load=other), explicit=False) == tmp_path / "r-2"
    assert capsys.readouterr().err == (f"run.dir: {d} already holds a run; this run writes to {tmp_path}/r-2 (its "
                                       "checkpoint.load lies outside it: add run.dir=<the folder of that run> to "
                                       "append there)\n")
    assert sorted(p.name for p in d.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]
    assert (d / "metrics.jsonl").read_text() == rows


def test_default_folder_holding_a_run_gives_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _hold_run(tmp_path / "outputs" / "tiny-tp1pp1-fp32")
    assert _single(_cfg(), explicit=True) == tmp_path / "outputs" / "tiny-tp1pp1-fp32-2"  # no run.dir: the config's


def test_command_line_folder_holding_a_run_is_refused_and_resume_appends(tmp_path):
    d = tmp_path / "r"
    _hold_run(d)
    with pytest.raises(ConfigError, match=r"run.dir=.*already holds a run \(config.yaml, metrics.jsonl\)") as err:
        _single(_cfg(run__dir=str(d)), explicit=True)
    assert err.value.symmetric  # the same line on every rank: rank 0 alone prints it
    # a resume from the folder's own checkpoints appends; from the command line's folder, any resume does
    assert _single(_cfg(run__dir=str(d), checkpoint__load=_checkpoint(d / "checkpoints")), explicit=False) == d
    assert _single(_cfg(run__dir=str(d), checkpoint__load=_checkpoint(tmp_path / "other")), explicit=True) == d
    assert not (tmp_path / "r-2").exists()


def test_composed_outside_a_hydra_app_counts_as_command_line():
    from mptrain.runs.folder import run_dir_from_command_line

    assert run_dir_from_command_line() is True
    assert run_dir_from_command_line(["model=tiny", "run.dir=S"]) and not run_dir_from_command_line(["model=tiny"])


def _claim_configured_on_world(rank, world_size, root, plan_on_rank1):
    """Every rank plans the configured folder (it holds a run) and claims it; rank 1 may be handed another plan."""
    from dataclasses import replace

    cfg = _cfg(run__dir=str(Path(root) / "run"))
    cfg.checkpoint.save = "${run.dir}/ck"
    config, plan = _planned(cfg, explicit=False)
    if rank == 1 and plan_on_rank1:  # as if another run had created folders between the ranks' plans
        config.run.dir = plan_on_rank1
        plan = replace(plan, dir=plan_on_rank1)
    try:
        return str(claim_run_dir(config, plan, rank=rank, world_size=world_size)), config.run.dir, config.checkpoint.save
    except ConfigError as e:
        return "ConfigError: " + str(e)


def test_world2_every_rank_plans_the_same_moved_folder(tmp_path):
    _hold_run(tmp_path / "run")
    out = run_distributed(_claim_configured_on_world, 2, str(tmp_path), None)
    moved = str(tmp_path / "run-2")
    assert out == [(moved, moved, f"{moved}/ck")] * 2
    assert sorted(p.name for p in (tmp_path / "run-2").iterdir()) == ["config.yaml"]


def test_world2_ranks_that_planned_different_folders_stop_before_the_folder(tmp_path):
    _hold_run(tmp_path / "run")
    out = run_distributed(_claim_configured_on_world, 2, str(tmp_path), str(tmp_path / "run-3"))
    assert out[0] == out[1] == (f"ConfigError: run.dir: rank 1 planned {tmp_path}/run-3, rank 0 {tmp_path}/run-2 "
                                "(another run was creating folders as this one started); start again, or pick the "
                                "folder with run.dir=")
    assert not (tmp_path / "run-2").exists() and not (tmp_path / "run-3").exists()


def test_run_dir_interpolation_is_the_default_run_folder_and_a_resume_appends_there(tmp_path, monkeypatch):
    """`checkpoint.save=${run.dir}/ckpt` without run.dir: the checkpoint lands in the default run folder
    (not `None/ckpt`), config.yaml records that path, and loading it back resumes in the same folder."""
    from train_utils import compose, read_rows

    from mptrain.training.run import run

    monkeypatch.chdir(tmp_path)
    base = ["model=tiny", "train.eval_interval=null", "checkpoint.save=${run.dir}/ckpt"]
    run(compose(base + ["train.train_iters=1"]))
    d = tmp_path / "outputs" / "tiny-tp1pp1-fp32"
    assert (d / "ckpt" / "latest").read_text().strip() == "1" and (d / "ckpt" / "iter_0000001").is_dir()
    saved = yaml.safe_load((d / "config.yaml").read_text())
    assert (saved["run"]["dir"], saved["checkpoint"]["save"]) == (str(d), "outputs/tiny-tp1pp1-fp32/ckpt")
    run(compose(base + ["train.train_iters=2", "checkpoint.load=${run.dir}/ckpt"]))
    assert (d / "ckpt" / "latest").read_text().strip() == "2"
    assert [r["iteration"] for r in read_rows(d)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["tiny-tp1pp1-fp32"]


def test_run_dir_interpolation_follows_the_default_folder_to_its_free_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _hold_run(tmp_path / "outputs" / "tiny-tp1pp1-fp32")
    composed = _cfg(checkpoint__save="${run.dir}/ck")
    config, plan = _planned(composed)
    assert composed.run.dir is None  # the caller's config is left alone
    assert claim_run_dir(config, plan, rank=0, world_size=1) == tmp_path / "outputs" / "tiny-tp1pp1-fp32-2"
    assert config.checkpoint.save == "outputs/tiny-tp1pp1-fp32-2/ck"
    saved = yaml.safe_load((tmp_path / "outputs" / "tiny-tp1pp1-fp32-2" / "config.yaml").read_text())
    assert saved["checkpoint"]["save"] == "outputs/tiny-tp1pp1-fp32-2/ck"
    sweep = SweepJob(root=str(tmp_path / "S"), subdir="precision=bf16", num=0, overrides=(), swept=("precision",))
    assert _planned(composed, sweep_job=sweep)[0].checkpoint.save == f"{tmp_path}/S/precision=bf16/ck"


def _other_runs_checkpoints(path: Path) -> None:
    (path / "iter_0000008").mkdir(parents=True)
    (path / "latest").write_text("8\n")


def test_fresh_run_into_a_checkpoint_save_holding_checkpoints_is_refused_before_writing(tmp_path):
    """checkpoint.save holding another run's checkpoints, no checkpoint.load: one line, nothing written
    (no run folder, `latest` untouched); the same folder as checkpoint.load resumes (checked alone here)."""
    from train_utils import compose

    from mptrain.runs.folder import checkpoint_save_refusal
    from mptrain.training.run import run

    ck = tmp_path / "ckcopy"
    _other_runs_checkpoints(ck)
    with pytest.raises(ConfigError) as err:
        run(compose(["model=tiny", "train.train_iters=1", f"checkpoint.save={ck}", f"run.dir={tmp_path}/r"]))
    assert str(err.value) == (f"checkpoint.save={ck} already holds checkpoints (latest = iteration 8) and this run does "
                              f"not resume from them; resume with checkpoint.load={ck}, or choose an empty "
                              "checkpoint.save folder")
    assert not (tmp_path / "r").exists() and (ck / "latest").read_text() == "8\n"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000008", "latest"]
    assert checkpoint_save_refusal(str(ck), f"{tmp_path}/./ckcopy") is None  # the restart pattern resumes
    assert checkpoint_save_refusal(str(tmp_path / "empty"), None) is None


def test_checkpoint_save_inside_run_dir_holding_checkpoints_is_refused_by_the_run_folder(tmp_path):
    """A resume from another folder into a run.dir whose `${run.dir}/ck` holds checkpoints: refused on
    rank 0's folder decision (symmetric), before config.yaml is rewritten."""
    d = tmp_path / "r"
    _hold_run(d)
    _other_runs_checkpoints(d / "ck")
    cfg = _cfg(run__dir=str(d), checkpoint__save="${run.dir}/ck", checkpoint__load=_checkpoint(tmp_path / "other"))
    with pytest.raises(ConfigError) as err:
        _single(cfg, explicit=True)
    assert err.value.symmetric
    assert str(err.value).startswith(f"checkpoint.save={d}/ck already holds checkpoints (latest = iteration 8) and "
                                     f"this run does not resume from them; resume with checkpoint.load={d}/ck")
    assert (d / "config.yaml").read_text() == "x: 1\n"
    assert _single(_cfg(run__dir=str(d), checkpoint__save="${run.dir}/ck", checkpoint__load="${run.dir}/ck"),
                   explicit=True) == d


def test_planned_default_folder_follows_the_checkpoints_model_name(tmp_path, monkeypatch):
    """`checkpoint.use_checkpoint_args` replaces model.name as the config resolves: the default folder names the
    checkpoint's model and the save folder inside it goes along; checkpoint.load (already read) stays."""
    from mptrain.config.schema import as_config

    def resolve(composed):  # as the trainer's resolve does with a checkpoint that brings its model
        config = as_config(composed)
        config.model.name = "llama"
        return config

    monkeypatch.chdir(tmp_path)
    _hold_run(tmp_path / "outputs" / "llama-tp1pp1-fp32")  # the checkpoint model's folder is planned like any other
    config, plan = planned_config(_cfg(checkpoint__save="${run.dir}/ck", checkpoint__load="${run.dir}/ck"),
                                  resolve=resolve)
    assert (config.run.dir, config.checkpoint.save, config.checkpoint.load) == (
        "outputs/llama-tp1pp1-fp32-2", "outputs/llama-tp1pp1-fp32-2/ck", "outputs/tiny-tp1pp1-fp32/ck")
    assert plan.configured == "outputs/llama-tp1pp1-fp32"


# --- relaunch: the same command started again (DESIGN.md §2) -------------------------------------------------
RELAUNCH = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=null"]


def test_relaunching_the_megatron_command_after_a_stop_resumes_in_its_folder(tmp_path, monkeypatch):
    """`checkpoint.save=D checkpoint.load=D` (Megatron's --save D --load D, D outside the run folder): the job
    stopped (a failure after checkpoint 2) and is started again as it was; it resumes in its folder, not `-2`."""
    from train_utils import compose, read_rows

    from mptrain.training.run import run

    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "ck"
    command = RELAUNCH + ["train.train_iters=3", "checkpoint.save_interval=2", f"checkpoint.save={ck}",
                          f"checkpoint.load={ck}"]
    with pytest.raises(RuntimeError, match="injected failure"):
        run(compose(command + ["debug.fail_rank=0", "debug.fail_iteration=3"]))
    d = tmp_path / "outputs" / "tiny-tp1pp1-fp32"
    assert (ck / "latest").read_text() == "2\n" and [r["iteration"] for r in read_rows(d)] == [1, 2]
    run(compose(command))
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["tiny-tp1pp1-fp32"]
    assert [r["iteration"] for r in read_rows(d)] == [1, 2, 3] and (ck / "latest").read_text() == "3\n"
    line = (f"run.dir: outputs/tiny-tp1pp1-fp32 holds this run (same config): resuming there from "
            f"checkpoint.save={ck} at iteration 2")
    assert (d / "train.log").read_text().splitlines().count(line) == 1


def test_a_finished_run_relaunched_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """`checkpoint.save=${run.dir}/ck`, no checkpoint.load: the finished run's command started again loads
    nothing and exits 0 with one line, every file as it was; with another config it is another run (`-2`)."""
    from train_utils import compose

    from mptrain.training.run import run

    monkeypatch.chdir(tmp_path)
    command = RELAUNCH + ["train.train_iters=2", "checkpoint.save=${run.dir}/ck"]
    first = run(compose(command))
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    capsys.readouterr()
    again = run(compose(command))
    out, err = capsys.readouterr()
    assert (out, err) == ("run.dir: outputs/tiny-tp1pp1-fp32 holds this run, finished: checkpoint.save="
                          "outputs/tiny-tp1pp1-fp32/ck is at iteration 2 >= train.train_iters=2; nothing to train, "
                          "nothing written (raise train.train_iters to train on)\n", "")
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(tmp_path.rglob("*")) if p.is_file()} == files
    assert [again[k] for k in ("run_dir", "final_loss", "layout")] == [first[k] for k in ("run_dir", "final_loss", "layout")]
    config, plan = planned_config(compose(command + ["optim.lr=0.002"]))
    assert (plan.dir, config.checkpoint.save, config.checkpoint.load, plan.relaunch) == (
        "outputs/tiny-tp1pp1-fp32-2", "outputs/tiny-tp1pp1-fp32-2/ck", None, None)
    assert plan.move_line == (
        "run.dir: outputs/tiny-tp1pp1-fp32 already holds a run; this run writes to outputs/tiny-tp1pp1-fp32-2 "
        "(outputs/tiny-tp1pp1-fp32/config.yaml differs: optim.lr 0.001 there, 0.002 here; resume there anyway with "
        "run.dir=outputs/tiny-tp1pp1-fp32 checkpoint.load=outputs/tiny-tp1pp1-fp32/ck)")


def _complete_checkpoint(folder: Path, iteration: int) -> None:
    """A checkpoint folder whose `iter_N` counts as complete (DCP's .metadata and meta.json; nothing loads it)."""
    from mptrain.checkpoint.atomic import iter_dir_name

    it = folder / iter_dir_name(iteration)
    it.mkdir(parents=True)
    (it / ".metadata").write_text("")
    (it / "meta.json").write_text("{}")
    (folder / "latest").write_text(f"{iteration}\n")


def test_a_relaunch_is_judged_by_the_folders_config_yaml(tmp_path):
    """run.dir from the command line: the same config relaunches (train.train_iters may change: the run trains
    on), loading its save folder; another config is refused, naming the keys that differ and both values; a
    sweep job's folder follows the same rule."""
    d = tmp_path / "r"

    def cfg(**dotted):
        return _cfg(**{"run__dir": str(d), "checkpoint__save": "${run.dir}/ck", "train__train_iters": 4, **dotted})

    _single(cfg())
    _complete_checkpoint(d / "ck", 4)
    config, plan = _planned(cfg(train__train_iters=8))
    assert (plan.dir, plan.resuming, config.checkpoint.load) == (str(d), True, f"{d}/ck")
    assert plan.relaunch.resume_line == (f"run.dir: {d} holds this run (same config; train.train_iters 4 there, 8 "
                                         f"here): resuming there from checkpoint.save={d}/ck at iteration 4")
    assert not plan.finished(8) and plan.finished(4)
    with pytest.raises(ConfigError) as err:
        _planned(cfg(train__train_iters=8, optim__lr=0.5, train__seed=7))
    assert str(err.value) == (f"run.dir={d} already holds a run and this run is not its relaunch ({d}/config.yaml "
                              "differs: optim.lr 0.001 there, 0.5 here; train.seed 1234 there, 7 here); resume it "
                              f"anyway with checkpoint.load={d}/ck, pick a new run.dir=, or delete the folder")
    # run.dir named by the config: the other config moves to `-2`; started again, it finds its run there
    other = cfg(optim__lr=0.5)
    config, plan = _planned(other, explicit=False)
    assert (plan.dir, plan.relaunch, config.checkpoint.save) == (f"{d}-2", None, f"{d}-2/ck")
    claim_run_dir(config, plan, rank=0, world_size=1)
    _complete_checkpoint(tmp_path / "r-2" / "ck", 4)
    config, plan = _planned(other, explicit=False)
    assert (plan.dir, plan.relaunch.iteration, config.checkpoint.load) == (f"{d}-2", 4, f"{d}-2/ck")
    assert plan.move_line == (f"run.dir: {d} already holds a run; this run writes to {d}-2 ({d}/config.yaml differs: "
                              f"optim.lr 0.001 there, 0.5 here; {d}-2 holds this command's run)")
    root, sub = tmp_path / "S", "train.seed=1"
    job = SweepJob(root=str(root), subdir=sub, num=0, overrides=(sub,), swept=("train.seed",))
    swept = _cfg(run__dir=str(root), checkpoint__save="${run.dir}/ck", train__seed=1)
    _single(swept, sweep_job=job)
    _complete_checkpoint(root / sub / "ck", 2)
    config, plan = _planned(swept, sweep_job=job)
    assert (plan.dir, config.checkpoint.load, plan.relaunch.iteration) == (str(root / sub), f"{root}/{sub}/ck", 2)
