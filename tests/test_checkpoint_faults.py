"""Checkpoint faults with real subprocesses: SIGKILL in the middle of a save, and an injected
exception on rank 2 of a 4-process torchrun job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import run_distributed
from procs import run_python, start_python
from train_utils import read_rows, run_job, without_timing
from warm_python import warm_env

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "model.num_layers=2", "model.hidden_size=32", "model.seq_length=16", "train.eval_interval=null",
         "train.global_batch_size=8", "train.micro_batch_size=2"]

# Runs a world-1 job that saves at 4 and 8; the save of iteration 8 stops at the chosen point (after
# DCP wrote the shard files into iter_0000008.tmp, or after the folder was renamed but before `latest`
# was replaced), drops a KILL_ME marker and sleeps: the test SIGKILLs it there.
SAVER = r'''
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from train_utils import compose
import torch.distributed.checkpoint.filesystem as fs
mode, root, run_dir = sys.argv[1:4]

def stall():
    Path(root, "KILL_ME").write_text(mode)
    time.sleep(300)

if mode == "dcp_write":
    original = fs.FileSystemWriter.write_data
    def write_data(self, plan, planner):
        future = original(self, plan, planner)
        if "iter_0000008" in str(self.path):
            stall()
        return future
    fs.FileSystemWriter.write_data = write_data
elif mode == "before_latest":
    original_replace = os.replace
    def replace(src, dst, *a, **k):
        if str(dst).endswith("latest") and Path(root, "iter_0000008").exists():
            stall()
        return original_replace(src, dst, *a, **k)
    os.replace = replace
from mptrain.training.run import run
run(compose(sys.argv[4:]))
'''


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.parametrize("mode", ["dcp_write", "before_latest"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, mode):
    root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(tests=str(Path(__file__).parent)))
    overrides = SMALL + ["train.train_iters=8", "checkpoint.save_interval=4", f"checkpoint.save={root}", f"run.dir={run_dir}"]
    # the saver forked from the tests' preloaded forkserver (procs.py; suite time): the SIGKILL, not interpreter
    # start-up, is what this test is about
    proc = start_python([str(script), mode, str(root), str(run_dir), *overrides], env=_clean_env())
    try:
        deadline = time.monotonic() + 120  # hang guard only (start-up + 8 tiny iterations take a few seconds)
        while not (root / "KILL_ME").exists():
            assert proc.poll() is None, proc.stderr_text()[-3000:]
            assert time.monotonic() < deadline, "the saver never reached the kill point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (root / "latest").read_text().strip() == "4"
    assert (root / "iter_0000004" / ".metadata").is_file()
    if mode == "dcp_write":
        assert (root / "iter_0000008.tmp").is_dir() and not (root / "iter_0000008").exists()
        assert list((root / "iter_0000008.tmp").glob("*.distcp"))  # killed with shard data half-published
    else:
        assert (root / "iter_0000008" / ".metadata").is_file()  # renamed, but latest still names 4
    # resume from what `latest` names: iteration 4; the next save replaces the debris and moves latest to 8
    (root / "KILL_ME").unlink()
    resumed = tmp_path / "resumed"
    run_distributed(run_job, 1, SMALL + ["train.train_iters=8", f"checkpoint.load={root}", f"checkpoint.save={root}",
                                         f"run.dir={resumed}"])
    rows = read_rows(resumed)
    assert [r["iteration"] for r in rows] == [5, 6, 7, 8]
    assert "loaded iteration 4 " in (resumed / "train.log").read_text()
    assert (root / "latest").read_text().strip() == "8"
    assert not (root / "iter_0000008.tmp").exists() and (root / "iter_0000008" / ".metadata").is_file()


@pytest.fixture(scope="module", autouse=True)
def injected_failure_job(tmp_path_factory):
    """The 4-process torchrun job of `test_injected_exception_on_rank_2_of_4_ends_the_job`, started with the
    module's first test and run beside the module's other tests (suite time: those run one process, a forked
    trainer or a world-1 pool job, and leave a core idle). ``injected_failure_job()`` -> (its folder, returncode,
    stderr text, elapsed_s from its own launch, whether a process of its group survived torchrun's exit)."""
    tmp_path = tmp_path_factory.mktemp("injected")
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=4", "train.py",
           "parallel=tp2pp2", *SMALL, "train.train_iters=6", f"run.dir={tmp_path / 'run'}",
           f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=2",
           "debug.fail_rank=2", "debug.fail_iteration=3"]
    t0 = time.monotonic()
    # the workers served warm (tests/warm_python.py; suite time)
    proc = subprocess.Popen(cmd, cwd=REPO, env=warm_env(_clean_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)

    def wait():
        try:
            _, err = proc.communicate(timeout=170)  # hang guard: a hung job would sit in gloo for train.timeout_s
            elapsed_s = time.monotonic() - t0
            try:
                os.killpg(proc.pid, 0)
                survived = True
            except ProcessLookupError:  # no process of the job survives torchrun
                survived = False
            return tmp_path, proc.returncode, err.decode(), elapsed_s, survived
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(wait)
        yield future.result
        if not future.done():  # the test was not selected: end the job instead of waiting for it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def test_injected_exception_on_rank_2_of_4_ends_the_job(injected_failure_job):
    """torchrun with 4 gloo processes; rank 2 raises in forward at iteration 3: every process exits, non-zero."""
    tmp_path, returncode, text, elapsed_s, survived = injected_failure_job()
    assert returncode != 0, text[-3000:]
    assert "injected failure on rank 2 at iteration 3 in forward" in text, text[-3000:]
    assert not survived  # no process of the job survives torchrun
    # The bound is 60 s from the failure; on this 2-core box start-up of 4 processes (~10-20 s) is
    # included here, so the bound checked is 60 s + start-up allowance (a hang would last train.timeout_s=600 s).
    assert elapsed_s < 100, elapsed_s
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"  # the save before the failure survives


def test_sigterm_finishes_the_step_saves_and_exits_0(tmp_path):
    """python train.py (world 1): SIGTERM after a few iterations -> checkpoint of the last finished step, exit 0."""
    root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    # forked from the tests' preloaded forkserver (procs.py; suite time): the trainer's SIGTERM handling, not
    # interpreter start-up, is what this test is about
    proc = start_python(["train.py", *SMALL, "train.train_iters=100000", f"checkpoint.save={root}", f"run.dir={run_dir}"],
                        cwd=REPO, env=_clean_env())
    try:
        deadline = time.monotonic() + 120  # hang guard only
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stderr_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    last = read_rows(run_dir)[-1]["iteration"]
    assert 3 <= last < 100000
    assert (root / "latest").read_text().strip() == str(last)
    assert (root / f"iter_{last:07d}" / ".metadata").is_file()


# python train.py, with (when no tmpfs can be mounted) DCP's file writes failing with ENOSPC from iteration 8 on
_FULL_DISK = r'''
import errno, sys
sys.path.insert(0, {src!r})
if {simulate!r}:
    import torch.distributed.checkpoint.filesystem as fs
    original = fs.FileSystemWriter.write_data
    def write_data(self, plan, planner):
        if "iter_0000008" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, plan, planner)
    fs.FileSystemWriter.write_data = write_data
sys.argv[0] = {train!r}
import runpy
runpy.run_path({train!r}, run_name="__main__")
'''


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs (one tiny checkpoint of ~3.7 MB fits, two do not); None when mounting is not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], capture_output=True).returncode == 0
    yield disk, mounted
    if mounted:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_full_disk_at_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, small_disk):
    """checkpoint.save on a full disk: one stderr line (and in train.log) naming the folder, the cause and the fix,
    exit 1; iter_0000008.tmp removed; `latest` still 4 and that checkpoint loads. A real 6 MiB tmpfs when the
    test may mount one (root), else ENOSPC injected into DCP's FileSystemWriter."""
    disk, mounted = small_disk
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK.format(src=str(REPO / "src"), simulate=not mounted, train=str(REPO / "train.py")))
    common = ["model=tiny", "train.eval_interval=null", "run.progress_bar=false"]
    out = run_python([str(script), *common, "train.train_iters=8", "checkpoint.save_interval=4", f"checkpoint.save={disk}",
                      f"run.dir={tmp_path}/r"], cwd=REPO, env=_clean_env(), timeout=240)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"error: checkpoint.save={disk}: saving iteration 8 failed: no space left on device; "
                               "iter_0000008.tmp removed and the previous checkpoint (iteration 4) is intact"), lines
    assert lines[0] in (tmp_path / "r" / "train.log").read_text().splitlines()
    assert sorted(p.name for p in disk.iterdir() if p.name != "lost+found") == ["iter_0000004", "latest"]
    rows = run_distributed(run_job, 1, common + ["train.train_iters=5", f"checkpoint.load={disk}", f"run.dir={tmp_path}/r2"])
    assert [r["iteration"] for r in read_rows(tmp_path / "r2")] == [5]  # resumed from iteration 4
    del rows


def test_corrupt_or_truncated_shard_is_one_line_and_latest_falls_back(tmp_path):
    """Every checkpoint has a CRC32 manifest; a flipped byte in iter_0000008's shard: loading `latest` falls back
    to iteration 4 and the log names the file; checkpoint.load_iteration=8 is one ConfigError naming the file;
    a truncated shard likewise."""
    import json

    ck = tmp_path / "ck"
    common = SMALL + [f"checkpoint.save={ck}"]
    run_distributed(run_job, 1, common + ["train.train_iters=8", "checkpoint.save_interval=4", f"run.dir={tmp_path}/a"])
    manifest = json.loads((ck / "iter_0000008" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "meta.json"]
    shard = ck / "iter_0000008" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    load = [f"checkpoint.load={ck}", "checkpoint.save=null", "train.train_iters=9"]
    run_distributed(run_job, 1, SMALL + load + [f"run.dir={tmp_path}/b"])
    assert [r["iteration"] for r in read_rows(tmp_path / "b")] == [5, 6, 7, 8, 9]  # resumed from iteration 4
    log = (tmp_path / "b" / "train.log").read_text()
    assert f"checkpoint: {shard} is corrupt (crc32 " in log and "loading iteration 4, the newest intact checkpoint" in log
    # (the pool re-raises a rank's exception as DistributedTestError with its traceback: match the ConfigError line)
    with pytest.raises(Exception, match=rf"ConfigError: checkpoint.load_iteration=8: {shard} is corrupt \(crc32 "):
        run_distributed(run_job, 1, SMALL + load + ["checkpoint.load_iteration=8", f"run.dir={tmp_path}/c"])
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(Exception, match=rf"ConfigError: checkpoint.load_iteration=8: {shard} is truncated or padded \(100 bytes"):
        run_distributed(run_job, 1, SMALL + load + ["checkpoint.load_iteration=8", f"run.dir={tmp_path}/d"])


def test_async_save_resumes_bitwise(tmp_path):
    """checkpoint.async_save=true at tp2 (world 2): the saves of iterations 4 and 8 are written by a background
    thread over a gloo group of their own and published (manifest, `latest` = 8) before the job ends; resuming from
    the async-saved iteration 4 gives rows 5-8 equal to an uninterrupted run's bitwise."""
    import json

    strip = without_timing
    ck = tmp_path / "ck"
    tp2 = SMALL + ["parallel=tp2pp1", "train.train_iters=8"]
    run_distributed(run_job, 2, tp2 + [f"checkpoint.save={ck}", "checkpoint.save_interval=4", "checkpoint.async_save=true",
                                       f"run.dir={tmp_path}/a"])
    assert (ck / "latest").read_text() == "8\n"
    assert sorted(json.loads((ck / "iter_0000004" / "manifest.json").read_text())["files"]) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    log = (tmp_path / "a" / "train.log").read_text()
    assert f"checkpoint: saved iteration 8 to {ck / 'iter_0000008'}" in log
    run_distributed(run_job, 2, tp2 + [f"checkpoint.load={ck}", "checkpoint.load_iteration=4", f"run.dir={tmp_path}/b"])
    assert strip(read_rows(tmp_path / "b")) == strip(read_rows(tmp_path / "a"))[4:]


def test_crash_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    """An async save that dies while iter_0000008.tmp is being written (debug.fail_where=save_write, in the
    background thread): the job fails when the end of the run waits for it, `latest` still names 4, and that
    checkpoint loads."""
    ck = tmp_path / "ck"
    with pytest.raises(Exception, match="injected failure on rank 0 at iteration 8 in save_write"):
        run_distributed(run_job, 1, SMALL + ["train.train_iters=8", f"checkpoint.save={ck}", "checkpoint.save_interval=4",
                                             "checkpoint.async_save=true", "debug.fail_rank=0", "debug.fail_iteration=8",
                                             "debug.fail_where=save_write", f"run.dir={tmp_path}/a"])
    assert (ck / "latest").read_text() == "4\n" and not (ck / "iter_0000008").exists()
    run_distributed(run_job, 1, SMALL + ["train.train_iters=5", f"checkpoint.load={ck}", f"run.dir={tmp_path}/b"])
    assert [r["iteration"] for r in read_rows(tmp_path / "b")] == [5]
