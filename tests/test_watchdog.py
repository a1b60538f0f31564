"""training/watchdog.py: the stop signal's grace timer and the per-step heartbeat end a stuck rank.

StepWatchdog runs in-process with an injected exit function (recorded, not fatal) and short limits.
StopSignal runs in subprocesses whose main thread is stuck in C code that never returns to the
interpreter (a relocked pthread mutex: unlike libc sleep, it is not cut short by a signal), as a
rank waiting on an NCCL collective whose peer died is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mptrain.training.watchdog import StepWatchdog, StopSignal

SRC = str(Path(__file__).resolve().parents[1] / "src")


class ExitRecorder:
    """Stands in for os._exit: records the code and the time of the call."""

    def __init__(self) -> None:
        self.codes: list = []
        self.times: list = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.times.append(time.monotonic())
        self.called.set()


# ---------------------------------------------------------------- StepWatchdog


def test_limit_is_step_timeout_plus_max_10_s_and_step_timeout():
    for step_timeout_s, limit_s in [(3, 13), (10, 20), (30, 60), (0.5, 10.5)]:
        dog = StepWatchdog(step_timeout_s, rank=0, exit_fn=ExitRecorder())
        assert dog.limit_s == limit_s
        dog.stop()
    with pytest.raises(ValueError, match="train.step_timeout_s"):
        StepWatchdog(0, rank=0)


def test_armed_step_past_the_limit_exits_1_once_with_one_line(capsys):
    exit_fn = ExitRecorder()
    dog = StepWatchdog(0.2, rank=1, grace_s=0.3, exit_fn=exit_fn)  # limit 0.5 s
    t0 = time.monotonic()
    dog.arm(3)
    assert exit_fn.called.wait(5.0)
    elapsed_s = exit_fn.times[0] - t0
    assert 0.5 <= elapsed_s < 1.5, elapsed_s
    time.sleep(0.6)  # no second call
    dog.stop()
    assert exit_fn.codes == [1]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["error: rank 1: iteration 3 did not finish within 0.5 s (train.step_timeout_s=0.2); "
                     "a peer rank failed or stalled; exiting"]


def test_message_names_rank_iteration_and_key(capsys):
    exit_fn = ExitRecorder()
    dog = StepWatchdog(10, rank=5, exit_fn=exit_fn)  # the production limit, 20 s
    dog.arm(42)
    # move the deadline instead of waiting 20 s (the message states limit_s)
    with dog._cond:
        dog._deadline = time.monotonic()
        dog._cond.notify()
    assert exit_fn.called.wait(5.0)
    dog.stop()
    err = capsys.readouterr().err
    assert err == ("error: rank 5: iteration 42 did not finish within 20 s (train.step_timeout_s=10); "
                   "a peer rank failed or stalled; exiting\n")


def test_disarmed_never_fires():
    exit_fn = ExitRecorder()
    dog = StepWatchdog(0.1, rank=0, grace_s=0.1, exit_fn=exit_fn)  # limit 0.2 s
    assert not exit_fn.called.wait(1.0)  # never armed
    dog.arm(2)
    dog.disarm()
    assert not exit_fn.called.wait(1.0)  # armed, then disarmed well inside the limit
    dog.stop()
    assert exit_fn.codes == []


def test_steps_that_finish_in_time_never_fire_even_when_their_sum_exceeds_the_limit():
    exit_fn = ExitRecorder()
    dog = StepWatchdog(0.2, rank=0, grace_s=0.2, exit_fn=exit_fn)  # limit 0.4 s
    t0 = time.monotonic()
    for iteration in range(2, 12):  # 10 steps of 0.2 s: 2 s armed in all, each step inside 0.4 s
        dog.arm(iteration)
        time.sleep(0.2)
        dog.disarm()
        time.sleep(0.05)
    assert time.monotonic() - t0 > 2 * dog.limit_s
    assert not exit_fn.called.wait(0.6)
    dog.stop()
    assert exit_fn.codes == []


def test_stop_ends_the_thread_and_an_armed_step_then_never_fires():
    exit_fn = ExitRecorder()
    dog = StepWatchdog(0.1, rank=0, grace_s=0.1, exit_fn=exit_fn)
    dog.arm(2)
    dog.stop()
    assert not dog._thread.is_alive()
    assert not exit_fn.called.wait(0.5)
    dog.stop()  # idempotent


def test_fires_when_built_and_armed_in_a_pool_worker_thread():
    exit_fn = ExitRecorder()

    def worker():
        dog = StepWatchdog(0.1, rank=3, grace_s=0.1, exit_fn=exit_fn)
        dog.arm(2)
        fired = exit_fn.called.wait(5.0)
        dog.stop()
        return fired

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(worker).result(timeout=10)
    assert exit_fn.codes == [1]


# ---------------------------------------------------------------- StopSignal

# The child installs StopSignal, prints "ready", then runs MAIN. STUCK relocks a pthread mutex:
# the main thread never returns to the interpreter, so the Python handler (_handle) never runs.
CHILD = """
import ctypes, signal, sys, time
sys.path.insert(0, {src!r})
from mptrain.training.watchdog import StopSignal
stop = StopSignal({kwargs})
before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))  # SIGINT is SIG_IGN under `cmd &`
stop.install()
print("ready", flush=True)
{main}
"""
STUCK = """
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # zeros = PTHREAD_MUTEX_INITIALIZER (a default, non-recursive mutex)
libc.pthread_mutex_lock(mutex)
libc.pthread_mutex_lock(mutex)  # deadlock; a signal's handler runs in C and the lock is retried
print("returned to Python", flush=True)
"""


def _start_child(main: str, kwargs: str = "") -> subprocess.Popen:
    code = CHILD.format(src=SRC, kwargs=kwargs, main=textwrap.dedent(main))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def _finish(proc: subprocess.Popen, timeout_s: float):
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the child was still running after {timeout_s} s; stderr: {err[-2000:]}")
    return out, err


# The children below wait out grace timers (10 s, 10 s, 3 s, 3 s, 4 s): they start together at the first
# test that asks for one (`children`) and run side by side, each test then reads its own child's outcome
# (suite time: ~11 s of waiting instead of ~31 s). Each child times itself from its own signal.
def _stuck_child(signum) -> dict:
    proc = _start_child(STUCK)  # default grace: max(10 s, 3 × step_time_s = 0)
    time.sleep(0.3)  # let the main thread reach the second lock
    t0 = time.monotonic()
    proc.send_signal(signum)
    out, err = _finish(proc, 15.0)
    return {"returncode": proc.returncode, "out": out, "err": err, "elapsed_s": time.monotonic() - t0}


def _three_step_times_child() -> dict:
    proc = _start_child("stop.step_time_s = 1.0\n" + STUCK, kwargs="min_grace_s=1.0")  # grace = 3 s
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = _finish(proc, 15.0)
    return {"returncode": proc.returncode, "out": out, "err": err, "elapsed_s": time.monotonic() - t0}


ACKNOWLEDGED = """
import os, threading
os.kill(os.getpid(), signal.SIGTERM)
deadline = time.monotonic() + 5
while not stop.received:  # the loop between steps
    assert time.monotonic() < deadline
    time.sleep(0.01)
time.sleep(0.2)  # the reader thread has seen the byte too: it must not start a second timer
stop.acknowledge()
os.kill(os.getpid(), signal.SIGTERM)  # a second signal during the save adds no timer
time.sleep(3.0)  # well past the 1 s grace
stop.uninstall()
assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
assert signal.set_wakeup_fd(-1) == -1
assert [t.name for t in threading.enumerate()] == ["MainThread"], threading.enumerate()
print("saved and exiting 0", flush=True)
"""

UNTIMED = """
import os
with stop.untimed():  # an evaluation longer than the 1 s grace
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2.5)
    with stop.untimed():  # nested: a save inside
        time.sleep(0.1)
    time.sleep(0.5)
    assert stop.received
print("evaluation done", flush=True)
time.sleep(5.0)  # now timed: the grace (1 s) runs out
print("returned to Python", flush=True)
"""


def _main_child(main: str, timeout_s: float) -> dict:
    proc = _start_child(main, kwargs="min_grace_s=1.0")
    t0 = time.monotonic()
    out, err = _finish(proc, timeout_s)
    return {"returncode": proc.returncode, "out": out, "err": err, "elapsed_s": time.monotonic() - t0}


CHILDREN = {
    signal.SIGTERM: lambda: _stuck_child(signal.SIGTERM),
    signal.SIGINT: lambda: _stuck_child(signal.SIGINT),
    "three_step_times": _three_step_times_child,
    "acknowledged": lambda: _main_child(ACKNOWLEDGED, 20.0),
    "untimed": lambda: _main_child(UNTIMED, 20.0),
}


@pytest.fixture(scope="module")
def children():
    """``children[name]()`` -> the outcome of CHILDREN[name] (all of them started at once, in threads)."""
    with ThreadPoolExecutor(len(CHILDREN)) as pool:
        futures = {name: pool.submit(fn) for name, fn in CHILDREN.items()}
        yield {name: (lambda f=f: f.result(timeout=60)) for name, f in futures.items()}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_main_thread_is_stuck_in_c_exits_1_after_the_grace(children, signum):
    r = children[signum]()
    assert r["returncode"] == 1, r["err"][-2000:]
    assert 9.5 <= r["elapsed_s"] < 15.0, r["elapsed_s"]
    assert r["err"] == (f"error: signal {int(signum)} received but the step did not finish within 10 s "
                        "(a peer rank failed?); exiting\n")
    assert "returned to Python" not in r["out"]


def test_grace_is_three_step_times_when_longer_than_the_minimum(children):
    r = children["three_step_times"]()
    assert r["returncode"] == 1, r["err"][-2000:]
    assert 2.8 <= r["elapsed_s"] < 8.0, r["elapsed_s"]
    assert "did not finish within 3 s" in r["err"]


def test_acknowledged_signal_is_not_killed_and_handlers_are_restored(children):
    """Normal flow: the loop sees `.received` between steps and acknowledges; nothing ends the process."""
    r = children["acknowledged"]()
    assert r["returncode"] == 0, r["err"][-2000:]
    assert "saved and exiting 0" in r["out"]
    assert "did not finish" not in r["err"]


def test_signal_inside_untimed_starts_the_grace_only_when_it_ends(children):
    """Evaluation / a checkpoint save (`untimed()`) may outlast the grace: a signal received there does not
    end the process during it; its grace timer starts when the region ends (the loop then acknowledges)."""
    r = children["untimed"]()
    assert r["returncode"] == 1, r["err"][-2000:]
    assert "evaluation done" in r["out"] and "returned to Python" not in r["out"]
    assert 3.5 <= r["elapsed_s"] < 8.0, r["elapsed_s"]  # 3.1 s untimed + 1 s grace
    assert r["err"] == "error: signal 15 received but the step did not finish within 1 s (a peer rank failed?); exiting\n"


def test_wakeup_bytes_are_forwarded_to_the_previous_wakeup_fd():
    code = f"""
import os, signal, sys, time
sys.path.insert(0, {SRC!r})
from mptrain.training.watchdog import StopSignal
signal.signal(signal.SIGUSR1, lambda *a: None)
r, w = os.pipe(); os.set_blocking(w, False)
signal.set_wakeup_fd(w)
stop = StopSignal(min_grace_s=30.0)
stop.install()
os.kill(os.getpid(), signal.SIGUSR1)
os.set_blocking(r, False)
deadline = time.monotonic() + 5
data = b""
while not data and time.monotonic() < deadline:
    time.sleep(0.01)
    try:
        data = os.read(r, 16)
    except BlockingIOError:
        pass
stop.uninstall()
assert signal.set_wakeup_fd(-1) == w
print(list(data))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"[{int(signal.SIGUSR1)}]"


def test_install_outside_the_main_thread_is_a_no_op():
    stop = StopSignal(exit_fn=ExitRecorder())
    before = signal.getsignal(signal.SIGTERM)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(stop.install).result(timeout=10)
        assert signal.getsignal(signal.SIGTERM) is before
        assert stop._reader is None
        pool.submit(stop.uninstall).result(timeout=10)
    assert not stop.received
