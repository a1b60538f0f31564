"""`debug.memory_snapshot=true`: CUDA allocator history over the loop, a pickle on rank 0.

- CPU through the trainer: one log line saying the option is CUDA-only, no file, training unchanged.
- The CUDA path as a unit: torch.cuda's recording functions monkeypatched with recorders, so the
  order (start recording → block → dump on rank 0 → stop recording) is checked without a GPU.
"""

from pathlib import Path

import pytest
import torch

from harness import run_distributed
from mptrain.training import memory
from mptrain.training.memory import CPU_MESSAGE, SNAPSHOT_FILE, memory_snapshot
from train_utils import read_rows, run_job

TINY = ["model=tiny", "model.num_layers=2", "model.seq_length=16", "train.eval_interval=null",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.train_iters=2"]


def test_cpu_run_logs_one_line_and_writes_no_snapshot(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    run_distributed(run_job, 1, TINY + ["debug.memory_snapshot=true", f"run.dir={on}"], timeout_s=180)
    run_distributed(run_job, 1, TINY + [f"run.dir={off}"], timeout_s=180)
    expected = CPU_MESSAGE.format(device="cpu")
    log_on = (on / "train.log").read_text().splitlines()
    assert sum(expected in line for line in log_on) == 1, log_on
    assert not any("memory_snapshot" in line for line in (off / "train.log").read_text().splitlines())
    assert not (on / SNAPSHOT_FILE).exists() and not (off / SNAPSHOT_FILE).exists()
    # the option changes nothing else: same losses, bitwise (same process kind, same math)
    assert [r["lm_loss"] for r in read_rows(on)] == [r["lm_loss"] for r in read_rows(off)]


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's availability and memory-history functions replaced by recorders (no GPU needed)."""
    calls = []

    def record(*args, **kwargs):
        calls.append(("record", args, kwargs))

    def dump(path):
        calls.append(("dump", (path,), {}))
        Path(path).write_bytes(b"fake snapshot")

    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory.torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(memory.torch.cuda.memory, "_dump_snapshot", dump)
    return calls


CUDA0 = torch.device("cuda", 0)  # a device object only: nothing is allocated on it


def test_cuda_rank0_records_during_the_block_then_dumps_and_stops(tmp_path, fake_cuda):
    lines = []
    with memory_snapshot(True, device=CUDA0, run_dir=tmp_path, rank=0, log=lines.append, max_entries=123) as path:
        assert path == tmp_path / SNAPSHOT_FILE
        assert fake_cuda == [("record", (), {"max_entries": 123})]  # recording started before the block body
    assert fake_cuda == [
        ("record", (), {"max_entries": 123}),
        ("dump", (str(tmp_path / SNAPSHOT_FILE),), {}),
        ("record", (), {"enabled": None}),  # recording stopped after the dump
    ]
    assert (tmp_path / SNAPSHOT_FILE).read_bytes() == b"fake snapshot"
    assert len(lines) == 1 and str(tmp_path / SNAPSHOT_FILE) in lines[0]


def test_cuda_other_ranks_and_disabled_do_nothing(tmp_path, fake_cuda):
    lines = []
    with memory_snapshot(True, device=torch.device("cuda", 1), run_dir=tmp_path, rank=1, log=lines.append) as path:
        assert path is None
    with memory_snapshot(False, device=CUDA0, run_dir=tmp_path, rank=0, log=lines.append) as path:
        assert path is None
    assert fake_cuda == [] and lines == [] and not (tmp_path / SNAPSHOT_FILE).exists()


def test_cuda_dump_happens_when_the_loop_raises_and_the_error_propagates(tmp_path, fake_cuda):
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        with memory_snapshot(True, device=CUDA0, run_dir=tmp_path, rank=0, log=lambda s: None):
            raise RuntimeError("CUDA out of memory (simulated)")
    assert [c[0] for c in fake_cuda] == ["record", "dump", "record"]
    assert (tmp_path / SNAPSHOT_FILE).exists()


def test_cuda_failing_dump_is_logged_and_recording_still_stops(tmp_path, fake_cuda, monkeypatch):
    def broken_dump(path):
        raise OSError("disk full")

    monkeypatch.setattr(memory.torch.cuda.memory, "_dump_snapshot", broken_dump)
    lines = []
    with memory_snapshot(True, device=CUDA0, run_dir=tmp_path, rank=0, log=lines.append):
        pass
    assert fake_cuda[-1] == ("record", (), {"enabled": None})
    assert len(lines) == 1 and "could not write" in lines[0] and "disk full" in lines[0]


def test_cpu_device_logs_even_when_cuda_is_available(tmp_path, fake_cuda):
    lines = []
    with memory_snapshot(True, device=torch.device("cpu"), run_dir=tmp_path, rank=0, log=lines.append) as path:
        assert path is None
    assert lines == [CPU_MESSAGE.format(device="cpu")] and fake_cuda == []
