"""The loop's owners decide their own "when" (evaluation, saves, early stops), and the fault hooks of
`mptrain.training.faults` exist only when a fault is configured (unit level, no process group)."""

import types

import pytest
import torch

from mptrain.config.schema import Config
from mptrain.training.checkpointing import Checkpointer, Progress
from mptrain.training.evaluation import Evaluator
from mptrain.training.faults import FaultHook, install_fault_hooks


def _cfg(**train_and_checkpoint) -> Config:
    cfg = Config()
    for key, value in train_and_checkpoint.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


class _Groups:
    rank = 0
    ranks = {"dp": [0, 2]}

    def __init__(self):
        self.any_rank_calls = []

    def any_rank(self, flag: bool) -> bool:
        self.any_rank_calls.append(flag)
        return flag


def _checkpointer(cfg: Config, received: bool = False):
    stop = types.SimpleNamespace(received=received, acknowledged=0)
    stop.acknowledge = lambda: setattr(stop, "acknowledged", stop.acknowledged + 1)
    built = types.SimpleNamespace(cfg=cfg, groups=_Groups())
    return Checkpointer(built, None, stop=stop, untimed=None, hooks=[]), stop, built.groups


def test_checkpointer_saves_at_the_interval_the_last_iteration_and_a_stop():
    ckpt, _, _ = _checkpointer(_cfg(train__train_iters=7, checkpoint__save="ckpt", checkpoint__save_interval=3))
    assert [i for i in range(1, 8) if ckpt.should_save(i, stopping=False)] == [3, 6, 7]
    assert ckpt.should_save(2, stopping=True)
    at = Progress(3, 24)
    at.advance(8)
    assert (at.iteration, at.consumed_samples) == (4, 32)
    unsaved, _, _ = _checkpointer(_cfg(train__train_iters=7, checkpoint__save_interval=3))  # checkpoint.save null
    assert not any(unsaved.should_save(i, stopping=True) for i in range(1, 8))


def test_checkpointer_stops_at_exit_interval_and_on_a_signal_agreed_by_every_rank():
    ckpt, stop, groups = _checkpointer(_cfg(train__train_iters=9, train__exit_interval=4, checkpoint__save="c"))
    assert [ckpt.stop_reason(i) for i in (3, 4, 5)] == [None, "exit_interval", "exit_interval"]
    assert groups.any_rank_calls == [False, False, False]  # every iteration: with checkpoint.save, a collective
    signalled, stop, groups = _checkpointer(_cfg(train__train_iters=9, checkpoint__save="c"), received=True)
    assert signalled.stop_reason(2) == "signal" and stop.acknowledged == 1 and groups.any_rank_calls == [True]
    alone, stop, groups = _checkpointer(_cfg(train__train_iters=9), received=True)  # no save: no collective
    assert alone.stop_reason(2) == "signal" and groups.any_rank_calls == []


def test_evaluator_validates_every_interval_before_the_last_iteration():
    def evaluator(**keys):
        return Evaluator(types.SimpleNamespace(cfg=_cfg(**keys)), None, untimed=None, collector=None)

    periodic = evaluator(train__train_iters=6, train__eval_interval=2, train__eval_iters=1)
    assert [i for i in range(1, 7) if periodic.should_evaluate(i)] == [2, 4]  # 6: the final evaluation's
    assert not any(evaluator(train__train_iters=6, train__eval_interval=None).should_evaluate(i) for i in range(7))
    no_batches = evaluator(train__train_iters=6, train__eval_interval=2, train__eval_iters=0)
    assert not any(no_batches.should_evaluate(i) for i in range(7))


class _Chunk:
    pre_process, post_process = True, False

    def __init__(self):
        self.grad = torch.zeros(3)

    def named_main_grads(self):
        return [("w", None, self.grad)]


def _built(**debug):
    cfg = Config()
    for key, value in debug.items():
        setattr(cfg.debug, key, value)
    trainer = types.SimpleNamespace(forward_step=lambda it, model: ("out", it), finalize_model_grads=lambda *a: 5.0)
    return types.SimpleNamespace(cfg=cfg, groups=_Groups(), chunks=[_Chunk()], trainer=trainer, faults=None)


def test_no_fault_key_installs_no_hook():
    built = _built()
    forward_step, finalize = built.trainer.forward_step, built.trainer.finalize_model_grads
    assert install_fault_hooks(built, attempt=0) == []
    assert built.trainer.forward_step is forward_step and built.trainer.finalize_model_grads is finalize
    assert built.faults is None
    other_rank = _built(fail_rank=None, nonfinite_grad_rank=1, sleep_rank=1, sleep_seconds=5.0)  # rank 0 not in it
    assert install_fault_hooks(other_rank, attempt=0) == []


def test_fault_hook_fails_at_its_site_and_iteration_only():
    built = _built(fail_rank=0, fail_iteration=2, fail_where="forward")
    (hook,) = install_fault_hooks(built, attempt=0)
    assert isinstance(hook, FaultHook) and built.faults is hook.injector
    hook.before_step(1)
    assert built.trainer.forward_step("it", _Chunk()) == ("out", "it")
    hook.before_step(2)
    hook.before_save(2)  # fail_where=forward: the save site does not fire
    with pytest.raises(RuntimeError, match="injected failure on rank 0 at iteration 2 in forward"):
        built.trainer.forward_step("it", _Chunk())
    restarted = _built(fail_rank=0, fail_iteration=2, fail_where="save")
    (hook,) = install_fault_hooks(restarted, attempt=1)  # torchrun's restart runs through
    hook.before_step(2)
    hook.before_save(2)


def test_fault_hook_poisons_the_grads_after_the_reduction_at_its_iteration(monkeypatch):
    slept = []
    monkeypatch.setattr("mptrain.training.faults.time.sleep", slept.append)
    built = _built(nonfinite_grad_rank=2, nonfinite_grad_iteration=3, sleep_rank=0, sleep_seconds=7.0)
    (hook,) = install_fault_hooks(built, attempt=0)  # rank 2 is rank 0's DP peer: its position is poisoned
    chunk = built.chunks[0]
    for iteration in (1, 2):
        hook.before_step(iteration)
        assert built.trainer.finalize_model_grads() == 5.0 and torch.equal(chunk.grad, torch.zeros(3))
    assert slept == [7.0]  # inside the second step
    hook.before_step(3)
    assert built.trainer.finalize_model_grads() == 5.0 and bool(torch.isnan(chunk.grad).all())
    assert built.faults is None  # no fail_rank: the checkpoint write has no fault site


def test_checkpointer_stops_once_the_exit_duration_has_passed_on_any_rank():
    import time

    cfg = _cfg(train__train_iters=9, train__exit_duration_in_mins=0.5)  # 30 s; no checkpoint.save
    fresh, _, groups = _checkpointer(cfg)
    assert [fresh.stop_reason(i) for i in (1, 2)] == [None, None]
    assert groups.any_rank_calls == [False, False]  # a collective every iteration, even without checkpoint.save
    late, _, groups = _checkpointer(cfg)
    late.start_time = time.time() - 31.0  # 31 s > 30 s since the job started
    assert late.stop_reason(1) == "exit_duration" and groups.any_rank_calls == [True]
    interval_first, _, _ = _checkpointer(_cfg(train__train_iters=9, train__exit_interval=1,
                                              train__exit_duration_in_mins=0.5))
    interval_first.start_time = time.time() - 31.0
    assert interval_first.stop_reason(1) == "exit_interval"


def test_exit_duration_saves_and_exits_cleanly(tmp_path):
    """A job past train.exit_duration_in_mins after its first iteration saves that iteration and returns (exit 0);
    a resume from that checkpoint trains on to train.train_iters."""
    from harness import run_distributed
    from train_utils import read_rows, run_job

    common = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16",
              "train.eval_interval=null", "train.global_batch_size=4", "train.micro_batch_size=2",
              "train.train_iters=5", f"run.dir={tmp_path / 'run'}", f"checkpoint.save={tmp_path / 'ckpt'}"]
    run_distributed(run_job, 1, common + ["train.exit_duration_in_mins=1e-9"])
    assert [r["iteration"] for r in read_rows(tmp_path / "run")] == [1]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "1"
    assert "stopped after iteration 1 (exit_duration); checkpoint saved" in (tmp_path / "run" / "train.log").read_text()
    run_distributed(run_job, 1, common + [f"checkpoint.load={tmp_path / 'ckpt'}"])
    assert [r["iteration"] for r in read_rows(tmp_path / "run")] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("minutes", [0, -1.0])
def test_exit_duration_must_be_positive(minutes):
    from mptrain.errors import ConfigError
    from mptrain.training.validate import validate_config
    from train_utils import compose

    with pytest.raises(ConfigError) as err:
        validate_config(compose(["model=tiny", f"train.exit_duration_in_mins={minutes}"]), 1)
    assert str(err.value).startswith(f"train.exit_duration_in_mins={float(minutes)} must be a number of minutes > 0")
