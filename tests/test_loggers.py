"""Experiment loggers with the real packages (wandb offline, TensorBoard) and a user's CSV logger.

One shared training run (world 2, tp1pp2: the loss reaches rank 0 from the last stage) stops at
iteration 3 (exit_interval) and resumes to 6 with `logger=[wandb,tensorboard]` plus the example
plugin `mptrain_plugins.loggers.CSVLogger`; the tests read what each logger wrote with that
package's own reader and compare names, steps and values with metrics.jsonl.
"""

from __future__ import annotations

import csv
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from harness import run_distributed
from mptrain.components import build
from mptrain.training.validate import validate_config
from mptrain.errors import ConfigError
from mptrain.training.loggers import (
    LOGGER_KIND,
    TensorBoardLogger,
    WandbLogger,
    build_loggers,
    check_logger_config,
    logged_metrics,
)
from mptrain.config.schema import as_config
from train_utils import compose, run_job

SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.global_batch_size=4",
         "train.micro_batch_size=2", "train.eval_interval=2", "train.eval_iters=1", "train.train_iters=6"]
LOGGERS = ["logger=[wandb,tensorboard]", "+logger.loggers.csv._target_=mptrain_plugins.loggers.CSVLogger",
           "+logger.loggers.wandb.settings.x_disable_stats=true", "logger.project=mptrain-test", "logger.group=g",
           "logger.tags=[a,b]"]


def _run_with_env(rank, world, overrides, env):
    """Pool task: run a job with `env` set in the worker (the pool may have started before this test)."""
    os.environ.update(env)
    result = run_job(rank, world, overrides)
    if "wandb" in sys.modules:  # the worker lives on: end wandb's service as a process exit would, so the
        sys.modules["wandb"].teardown()  # offline run's file is complete when the test reads it
    return result


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("loggers")
    home = root / "home"
    env = {"WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR": str(home / "cache"),
           "WANDB_DATA_DIR": str(home / "data"), "WANDB_SILENT": "true"}
    run_dir, ckpt = root / "run", root / "ckpt"
    common = SMALL + LOGGERS + ["parallel=tp1pp2", f"run.dir={run_dir}", f"checkpoint.save={ckpt}"]
    run_distributed(_run_with_env, 2, common + ["train.exit_interval=3"], env)
    run_distributed(_run_with_env, 2, common + [f"checkpoint.load={ckpt}"], env)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


def _expected_by_step(rows) -> dict:
    """step → {name: value}, merging the rows of one iteration (a valid row shares its train row's step)."""
    out: dict = {}
    for row in rows:
        out.setdefault(row["iteration"], {}).update(logged_metrics(row))
    return out


# --- names --------------------------------------------------------------------------------------
def test_logged_names_are_split_slash_key_without_iteration():
    train = {"split": "train", "iteration": 7, "consumed_samples": 56, "lm_loss": 6.93, "lr": 3e-4, "grad_norm": None,
             "loss_scale": 65536.0, "skipped_iter": True, "skipped_iters_total": 3, "nan_iters_total": 0,
             "num_microbatches": 4, "tokens_per_s": 1234.5, "tflops_per_gpu": 1.2, "mfu": None, "mem_allocated_gib": None}
    assert logged_metrics(train) == {
        "train/consumed_samples": 56, "train/lm_loss": 6.93, "train/lr": 3e-4, "train/loss_scale": 65536.0,
        "train/skipped_iters_total": 3, "train/nan_iters_total": 0, "train/num_microbatches": 4,
        "train/tokens_per_s": 1234.5, "train/tflops_per_gpu": 1.2}
    assert logged_metrics({"split": "valid", "iteration": 10, "lm_loss": 2.5, "ppl": 12.18}) == {
        "valid/lm_loss": 2.5, "valid/ppl": 12.18}
    assert logged_metrics({"split": "test", "iteration": 10, "lm_loss": float("nan"), "ppl": None}) == {}


# --- config: options, several loggers, start-up checks -------------------------------------------
def test_options_select_targets_and_several_loggers_at_once():
    def targets(*overrides):
        lg = as_config(compose(list(overrides))).logger
        return {k: v["_target_"] for k, v in lg.loggers.items()}

    assert targets() == {} and targets("logger=none") == {}
    assert targets("logger=wandb") == {"wandb": "mptrain.training.loggers.WandbLogger"}
    assert targets("logger=tensorboard") == {"tensorboard": "mptrain.training.loggers.TensorBoardLogger"}
    assert targets("logger=[wandb,tensorboard]") == {"wandb": "mptrain.training.loggers.WandbLogger",
                                                     "tensorboard": "mptrain.training.loggers.TensorBoardLogger"}
    assert targets("logger=wandb", "+logger.loggers.csv._target_=mptrain_plugins.loggers.CSVLogger") == {
        "wandb": "mptrain.training.loggers.WandbLogger", "csv": "mptrain_plugins.loggers.CSVLogger"}


class NoFinish:
    def __init__(self, run_dir):
        pass

    def log_metrics(self, metrics, step):
        pass


@pytest.mark.parametrize("overrides,message", [
    (["+logger.loggers.x._target_=no_such_pkg.Logger"], "logger.loggers.x._target_=no_such_pkg.Logger does not import"),
    (["+logger.loggers.x._target_=test_loggers.NoFinish"], "logger.loggers.x._target_=test_loggers.NoFinish is not a "
                                                           "valid logger: it lacks finish"),
    (["logger=tensorboard", "+logger.loggers.tensorboard.flush_sec=5"],
     "logger.loggers.tensorboard.flush_sec: mptrain.training.loggers.TensorBoardLogger takes no keyword 'flush_sec'"),
    (["+logger.loggers.x=3"], "logger.loggers.x: expected a component node with _target_"),
    (["logger.mode=loud"], "logger.mode: unknown option 'loud'; valid: online, offline, disabled"),
    (["logger=wandb", "logger.tensorboard_dir=tb"],
     "logger.tensorboard_dir=tb has no effect without a TensorBoard logger; add logger=tensorboard"),
])
def test_bad_logger_is_one_config_error_line_at_validation(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_config(compose(["model=tiny", *overrides]), 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_package_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="logger.loggers.wandb._target_=mptrain.training.loggers.WandbLogger needs "
                                          "the 'wandb' package, which is not installed; pip install wandb"):
        check_logger_config(as_config(compose(["logger=wandb"])))


def test_other_ranks_build_nothing(tmp_path):
    cfg = as_config(compose(["logger=[wandb,tensorboard]"]))
    assert build_loggers(cfg.logger, rank=1, run_dir=tmp_path).loggers == []
    assert list(tmp_path.iterdir()) == []


# --- what each logger wrote, read back with its package's reader ----------------------------------
def _wandb_records(path: Path):
    """The protobuf records of a `.wandb` file (wandb's transaction log: LevelDB log framing, 32 KiB blocks).

    wandb 0.2x ships the reader (`wandb.sdk.internal.datastore.DataStore`); 0.3x moved the writer
    into wandb-core (Go) and dropped it, so the same framing is read here with the same record
    type, `wandb.proto.wandb_internal_pb2.Record`.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    try:
        from wandb.sdk.internal.datastore import DataStore  # wandb < 0.30
    except ImportError:
        DataStore = None
    raw = []
    if DataStore is not None:
        ds = DataStore()
        ds.open_for_scan(str(path))
        while (data := ds.scan_data()) is not None:
            raw.append(data)
    else:
        data = path.read_bytes()
        assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
        pos, block, pending = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind == 1:  # FULL
                raw.append(chunk)
            elif kind == 2:  # FIRST
                pending = chunk
            elif kind == 3:  # MIDDLE
                pending += chunk
            elif kind == 4:  # LAST
                raw.append(pending + chunk)
    records = []
    for item in raw:
        rec = pb.Record()
        rec.ParseFromString(item)
        records.append(rec)
    return records


def _wandb_run(path: Path):
    """(run id, config dict, {step: {name: value}}) of one offline run's .wandb file."""
    run_id, config, history = None, {}, {}
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
            config = {u.key: json.loads(u.value_json) for u in rec.run.config.update if u.key != "_wandb"}
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(rec.history.step.num, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
    return run_id, config, history


def test_wandb_offline_run_holds_metrics_jsonl_and_resume_continues_the_run(resumed_run):
    run_dir, rows = resumed_run
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # two attempts, one per process start
    runs = [_wandb_run(f) for f in files]
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert [r[0] for r in runs] == [run_id, run_id]  # the resumed attempt continues the same wandb run
    merged: dict = {}
    for _, _, history in runs:
        for step, items in history.items():
            merged.setdefault(step, {}).update(items)
    assert merged == _expected_by_step(rows)  # every name, step and value (JSON floats read back exactly)
    names = set().union(*merged.values())
    assert {"train/lm_loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/tokens_per_s", "valid/lm_loss",
            "valid/ppl", "test/lm_loss", "test/ppl"} <= names
    assert not any(n.startswith(("train/train", "train/valid", "train/test")) or n.endswith("/iteration") for n in names)
    assert sorted(merged) == list(range(0, 7))
    # the run's config is the resolved config (config.yaml: the resumed attempt's)
    assert runs[1][1] == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert runs[0][1]["logger"]["project"] == "mptrain-test"


def test_tensorboard_event_files_hold_metrics_jsonl(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, rows = resumed_run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got: dict = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    expected = {step: {k: float(np.float32(v)) for k, v in items.items()}  # TensorBoard stores float32
                for step, items in _expected_by_step(rows).items()}
    assert got == expected


def test_user_csv_logger_from_the_command_line_writes_metrics_jsonl(resumed_run):
    run_dir, rows = resumed_run
    with open(run_dir / "metrics.csv", newline="") as f:
        got = [(int(r["step"]), r["name"], float(r["value"])) for r in csv.DictReader(f)]
    expected = [(row["iteration"], k, float(v)) for row in rows for k, v in logged_metrics(row).items()]
    assert got == expected


def test_console_lines_carry_the_iteration(resumed_run):
    run_dir, _ = resumed_run
    log = (run_dir / "train.log").read_text().splitlines()
    assert [line.split(" | ")[0] for line in log if "times (ms)" in line] == [f"iter {i}/6" for i in range(1, 7)]
    assert [line.split(" lm_loss")[0] for line in log if " valid lm_loss " in line or " test lm_loss " in line] == [
        "iter 0/6 | valid", "iter 2/6 | valid", "iter 4/6 | valid", "iter 6/6 | valid", "iter 6/6 | test"]


def test_tensorboard_resume_hides_the_steps_redone_after_the_checkpoint(tmp_path):
    """A crash after iteration 6 with the checkpoint at 4: the resumed attempt logs 5.. again, TensorBoard shows those."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardLogger(run_dir=tmp_path, run_config={"a": 1})
    for step in range(1, 7):
        first.log_metrics({"train/lm_loss": float(step)}, step)
    first.finish()
    second = TensorBoardLogger(run_dir=tmp_path, start_iteration=4)
    for step in range(5, 8):
        second.log_metrics({"train/lm_loss": 100.0 + step}, step)
    second.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/lm_loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0)]


def test_tensorboard_dir_is_where_the_event_files_go(tmp_path, monkeypatch):
    """`logger.tensorboard_dir` (Megatron's --tensorboard-dir): the events go there, a relative path under the working
    directory; null keeps `<run_dir>/tensorboard`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for overrides, expected in ((["logger.tensorboard_dir=tb/events"], tmp_path / "tb" / "events"),
                                ([f"logger.tensorboard_dir={tmp_path / 'abs'}"], tmp_path / "abs"),
                                ([], run_dir / "tensorboard")):
        cfg = as_config(compose(["logger=tensorboard", *overrides]))
        check_logger_config(cfg)
        group = build_loggers(cfg.logger, rank=0, run_dir=run_dir)
        (lg,) = group.loggers
        assert lg.log_dir == expected
        lg.log_metrics({"train/lm_loss": 2.5}, 1)
        group.finish()
        acc = EventAccumulator(str(expected))
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("train/lm_loss")] == [(1, 2.5)]


def test_wandb_logger_keywords_from_the_shared_logger_keys(tmp_path, monkeypatch):
    """`logger.project/run_name/group/tags/mode` reach wandb.init; disabled mode writes no run but keeps the id."""
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    cfg = as_config(compose(["logger=wandb", "logger.mode=disabled", "logger.run_name=r1", "logger.tags=[x]"]))
    group = build_loggers(cfg.logger, rank=0, run_dir=tmp_path, run_config={"k": 1})
    (lg,) = group.loggers
    assert isinstance(lg, WandbLogger) and lg.run.name == "r1"
    lg.log_metrics({"train/lm_loss": 1.0}, 1)
    group.finish()
    assert (tmp_path / "wandb" / "run_id").read_text().strip() == lg.run.id
    with pytest.raises(ConfigError, match="logger.loggers.w: mptrain.training.loggers.WandbLogger rejected its arguments"):
        build("logger.loggers.w", {"_target_": "mptrain.training.loggers.WandbLogger", "mode": "loud"}, LOGGER_KIND,
              runtime={"run_dir": tmp_path})


class FailingLogger:
    """A logger whose tracking server cannot be reached."""

    def __init__(self, run_dir=None):
        raise ValueError("cannot reach the tracking server")

    def log_metrics(self, metrics, step):
        pass

    def finish(self):
        pass


def _build_failing_loggers(rank, world, run_dir):
    from mptrain.groups import build_groups
    from mptrain.training.recorder import Recorder

    cfg = as_config(compose(["model=tiny", "+logger.loggers.bad._target_=test_loggers.FailingLogger"]))
    groups = build_groups(1, 1)
    try:
        recorder = Recorder(cfg=cfg, groups=groups, derived=None, run_dir=Path(run_dir), flops_per_iteration=1,
                            peak_tflops=None, t_start=0.0)
        with pytest.raises(ConfigError) as info:
            recorder._build_loggers(0)
        return str(info.value), info.value.symmetric
    finally:
        groups.destroy()


def test_a_logger_failing_on_rank_0_ends_every_rank_with_its_one_line(tmp_path):
    """Loggers are built on rank 0 alone: its failure reaches the other ranks as the same error (rank 0 prints
    it), instead of leaving them to fail in their next collective with a traceback of their own."""
    line = ("logger.loggers.bad: test_loggers.FailingLogger failed while being built (ValueError: cannot reach the "
            "tracking server); no logger.loggers.bad.* keys were given to it, so the cause is in the target or its "
            "environment")
    assert run_distributed(_build_failing_loggers, 2, str(tmp_path)) == [
        (line, True), (f"rank 0 could not build its loggers: {line}", True)]


class ProjectLogger(FailingLogger):
    """A logger that takes the shared `logger.project` key and rejects its value."""

    def __init__(self, run_dir=None, project=None):
        raise ValueError(f"project {project!r} does not exist on the server")


def test_a_rejected_shared_key_is_named_as_given(tmp_path):
    """A shared key (`logger.project`) the logger takes counts as given: the line names it and its fix, and
    does not say that no keys were given."""
    with pytest.raises(ConfigError) as err:
        build("logger.loggers.p", {"_target_": "test_loggers.ProjectLogger"}, LOGGER_KIND,
              runtime={"run_dir": tmp_path}, mapped={"project": "my-proj", "group": "g"})
    assert str(err.value) == ("logger.loggers.p: test_loggers.ProjectLogger rejected its arguments (ValueError: "
                              "project 'my-proj' does not exist on the server); fix the logger.loggers.p.* keys or the "
                              "shared keys it takes (given: project='my-proj' (a shared key))")
