"""`python ARGS` as a real child process without paying for the torch import each time (suite time).

`run_python(args, cwd=, env=, timeout=)` is a drop-in for
``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` for a script
(``[path, ...]``), a module (``["-m", name, ...]``) or code (``["-c", code, ...]``). The child is
forked from a multiprocessing *forkserver* that imported torch, Hydra and mptrain once (each
fresh interpreter costs 2-4 s of imports on a 2-core machine), then behaves like the interpreter
would: its own process, ``os.environ`` = ``env`` exactly, ``cwd``, ``sys.argv``, ``sys.path[0]``,
``__name__ == "__main__"``, fds 1 and 2 written to files the caller reads back, atexit handlers
run, and the exit status of ``sys.exit`` / an uncaught exception (1, traceback on stderr) /
``os._exit`` / a signal (negative, as `subprocess` reports it).

What it does not reproduce: interpreter start-up itself (a module's import-time failure before
``main`` would look the same, but the preloaded modules are not re-imported: source edited during
the test run is not seen; the forkserver starts at the first call). Tests about the launcher or
signal delivery to a fresh interpreter keep `subprocess` (tests/test_torchrun.py, test_watchdog.py); their
torchrun workers come warm from tests/warm_python.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile

# torch._dynamo: every torch optimizer's __init__ imports it (torch._disable_dynamo), ~2-5 s of CPU per child;
# torch._inductor.compile_fx: a pool worker's first Inductor compile imports it (~1 CPU-s, once per worker process,
# again after each pool recycle; no thread started at import)
_PRELOAD = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "hydra", "omegaconf", "mptrain.config.schema",
            "mptrain.training.run", "procs_freeze"]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def forkserver():
    """The preloaded forkserver's `multiprocessing` context, for a library function that takes one (its processes
    then start with torch, Hydra and mptrain imported: `mptrain.check.run_check`'s ranks)."""
    return _context()


def _child(args: list, cwd: str, env: dict, out_path: str, err_path: str) -> None:
    """Forkserver child: become ``python *args`` (never returns; exits with the script's status)."""
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    f = os.open(os.devnull, os.O_RDONLY)
    os.dup2(f, 0)
    os.close(f)
    become_python(args, cwd, env)


def become_python(args: list, cwd: str, env: dict) -> None:
    """In a process forked with torch imported, whose fds 0-2 are already the caller's: run ``python *args``
    (a script, ``-m module`` or ``-c code``; ``-u`` is accepted, output is unbuffered anyway) with ``env`` and
    ``cwd``, then exit with its status, as the interpreter would. Never returns."""
    import atexit
    import io
    import runpy
    import traceback

    args = list(args[1:] if args[:1] == ["-u"] else args)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by torch at its import, which the forkserver already did
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[:0] = [os.getcwd(), *extra]
            sys.modules.pop(args[1], None)  # `python -m X` has not imported X yet (runpy warns otherwise)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[:0] = ["", *extra]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            sys.argv = list(args)
            sys.path[:0] = [os.path.dirname(os.path.abspath(args[0])), *extra]
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # the interpreter prints it, then ends by SIGINT itself (the status says so)
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


class PythonChild:
    """A running ``python *args`` forked from the preloaded forkserver (`start_python`): the part of
    `subprocess.Popen` a test that kills the child needs (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``),
    and ``stderr_text()``, what the child wrote to its stderr so far. Its stdout is discarded."""

    def __init__(self, proc, tmp) -> None:
        self._proc, self._tmp = proc, tmp
        self.pid = proc.pid

    def poll(self):
        """The exit status (negative: the signal that ended it), or None while it runs."""
        return self._proc.exitcode

    def wait(self, timeout=None) -> int:
        """The exit status once the child ended. Raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self._proc.name, timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()

    def stderr_text(self) -> str:
        with open(os.path.join(self._tmp.name, "stderr")) as f:
            return f.read()


def start_python(args: list, *, cwd=None, env=None) -> PythonChild:
    """Start ``python *args`` in a child forked from the preloaded forkserver, without waiting (see `run_python`)."""
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    env = dict(os.environ if env is None else env)
    tmp = tempfile.TemporaryDirectory(prefix="start_python_")
    out_path, err_path = os.path.join(tmp.name, "stdout"), os.path.join(tmp.name, "stderr")
    for path in (out_path, err_path):
        open(path, "w").close()
    proc = _context().Process(target=_child, args=([os.fspath(a) for a in args], cwd, env, out_path, err_path))
    proc.start()
    return PythonChild(proc, tmp)


def run_python(args: list, *, cwd=None, env=None, timeout=None) -> subprocess.CompletedProcess:
    """``python *args`` in a child forked from the preloaded forkserver; stdout and stderr captured as text.

    Raises:
        subprocess.TimeoutExpired: the child ran past ``timeout`` seconds (it is killed first).
    """
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    env = dict(os.environ if env is None else env)
    args = [os.fspath(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="run_python_") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        proc = _context().Process(target=_child, args=(args, cwd, env, out_path, err_path))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()
        with open(out_path) as f_out, open(err_path) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    cmd = [sys.executable, *args]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)
