"""train.profile*: Megatron's profiler window (iterations start + 1 .. end on the listed ranks), its start-up
checks, and the torch.profiler trace a CPU run writes."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from harness import run_distributed
from mptrain.errors import ConfigError
from mptrain.training.profiler import ProfilerWindow
from mptrain.training.validate import validate_config
from train_utils import compose, run_job

TINY = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.eval_interval=null", "run.progress_bar=false"]


class Recording:
    """A capture that records what the window asks of it."""

    def __init__(self) -> None:
        self.calls: list = []

    def start(self, iteration: int) -> None:
        self.calls.append(("start", iteration))

    def step(self, iteration: int) -> None:
        self.calls.append(("step", iteration))

    def stop(self):
        self.calls.append(("stop",))


def _drive(window: ProfilerWindow, iterations) -> None:
    for iteration in iterations:
        window.before_step(iteration)
        window.after_step(iteration)


def test_window_covers_the_iterations_after_start_up_to_end():
    capture = Recording()
    _drive(ProfilerWindow(start=2, end=4, capture=capture), range(1, 8))  # Megatron's start 2, end 4: steps 3 and 4
    assert capture.calls == [("start", 3), ("step", 4), ("stop",)]
    resumed = Recording()
    _drive(ProfilerWindow(start=2, end=4, capture=resumed), range(4, 8))  # a resume past the start: no window
    assert resumed.calls == []
    cut = Recording()
    window = ProfilerWindow(start=2, end=6, capture=cut)
    _drive(window, range(1, 5))  # the run ends inside the window
    window.close()
    window.close()
    assert cut.calls == [("start", 3), ("step", 4), ("stop",)]


@pytest.mark.parametrize("keys, world, message", [
    ({"profile_step_start": 5, "profile_step_end": 5}, 1,
     r"^train.profile_step_end=5 must be > train.profile_step_start=5: .*set train.profile_step_end=7$"),
    ({"profile_step_start": -1}, 1, r"^train.profile_step_start=-1 must be >= 0"),
    ({"profile_ranks": [0, 2]}, 2, r"^train.profile_ranks=\[0, 2\] must list global ranks in \[0, 2\) \(world size 2\)"),
    ({"profile": False, "use_pytorch_profiler": True}, 1,
     r"^train.use_pytorch_profiler=true has no effect without train.profile=true"),
])
def test_profile_keys_are_checked_at_start_up(keys, world, message):
    cfg = compose(TINY + ["train.profile=true"])
    for key, value in keys.items():
        OmegaConf.update(cfg, f"train.{key}", value)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, world)


def test_cpu_run_writes_a_trace_of_exactly_the_window(tmp_path):
    run_distributed(run_job, 1, TINY + ["train.train_iters=4", "train.profile=true", "train.profile_step_start=1",
                                        "train.profile_step_end=3", f"run.dir={tmp_path}"])
    assert [p.name for p in tmp_path.glob("*.pt.trace.json")] == ["rank0.iter2-3.pt.trace.json"]
    events = json.loads((tmp_path / "rank0.iter2-3.pt.trace.json").read_text())["traceEvents"]
    steps = {e["name"]: e for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#2", "ProfilerStep#3"]
    # every op recorded ran inside those two iterations: the profiler was on for them only
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::mm" for e in ops)
    begin, end = steps["ProfilerStep#2"]["ts"], steps["ProfilerStep#3"]["ts"] + steps["ProfilerStep#3"]["dur"]
    assert all(begin <= e["ts"] and e["ts"] + e["dur"] <= end for e in ops)
    log = (tmp_path / "train.log").read_text()
    assert f"profile: iterations 2-3 on ranks [0] with torch.profiler, traces in {tmp_path}\n" in log
    assert f"profile: trace written to {tmp_path / 'rank0.iter2-3.pt.trace.json'}\n" in log
