"""`torchrun`'s workers without paying for the torch import in each: a Python "executable" served warm.

torchrun starts each worker as ``$PYTHON_EXEC -u train.py ARGS`` (`torch.distributed.run`: ``PYTHON_EXEC``,
default ``sys.executable``). `warm_env(env)` returns ``env`` with ``PYTHON_EXEC`` set to a shim: a tiny script
(``python -S``, stdlib only, ~20 ms) that hands its argv, environment, folder and fds 0-2 to a server over a
Unix socket. The server, forked from the tests' preloaded forkserver (procs.py: torch, Dynamo, Hydra and
mptrain imported once), forks a child that becomes ``python ARGS`` on those fds (`procs.become_python`), and
reports the child's exit status back; the shim exits with it (a child ended by a signal: the shim ends by
the same signal). So a worker of a 4-process job costs its work, not ~4 s of imports.

What the shim keeps of a real worker: its own process (torchrun's ``Popen``, in its own process group), the exit
status torchrun reads, signals: the shim forwards SIGTERM / SIGINT / SIGHUP / SIGQUIT / SIGUSR1 / SIGUSR2 to
the child (torchrun's ``killpg`` reaches the shim's group only); a SIGKILLed shim (torchrun's escalation)
takes the child with it (the server kills a child whose shim's connection closed). What it does not: the
child's parent is the server, not the shim; source edited during the test run is not seen (as for every
forked test process); interpreter start-up itself is not exercised (tests/test_main_job.py and
tests/test_wheel.py keep real interpreters for that).

The shim stands in for ``python`` on any command line (`warm_command`): ``[shim, "-m", "torch.distributed.run",
...]`` is torchrun's own agent, in a process forked with torch imported (~1.7 CPU-s of imports fewer a launch).
A test about what the agent does with its workers (restart, teardown, rendezvous, Ctrl-C to the terminal's
process group) keeps a fresh interpreter for the agent: the agent a shim serves is not in the shim's process
group, and is the server's child.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
import time

_SERVER = None  # (process, socket path, shim path), started at the first `warm_env`

_SHIM = """#!{python} -S
import json, os, signal, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect({sock!r})
socket.send_fds(s, [json.dumps([sys.argv[1:], dict(os.environ), os.getcwd()]).encode()], [0, 1, 2])
pid = int(s.recv(64))
def forward(sig, frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
kind, n = s.recv(64).split()
n = int(n)
if kind == b"signal":
    if n != signal.SIGKILL:
        signal.signal(n, signal.SIG_DFL)
    os.kill(os.getpid(), n)
sys.exit(n)
"""


def _serve(path: str) -> None:
    """The server loop (single-threaded: it forks). Children by pid -> the shim's connection."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(128)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    children: dict = {}
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is srv:
                conn, _ = srv.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
                argv, env, cwd = json.loads(msg)
                pid = os.fork()
                if pid == 0:
                    _become(argv, env, cwd, fds, (srv, conn, *(c for c in children.values())))
                for fd in fds:
                    os.close(fd)
                conn.send(str(pid).encode())
                children[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            elif not key.fileobj.recv(64):  # the shim died (SIGKILL): its child goes too
                try:
                    os.kill(key.data, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            try:
                conn.send(f"signal {sig}".encode() if sig else f"exit {os.WEXITSTATUS(status)}".encode())
            except OSError:  # the shim is gone already
                pass
            sel.unregister(conn)
            conn.close()


def _become(argv, env, cwd, fds, sockets) -> None:
    """The forked child: the shim's fds as 0-2, the server's sockets closed, then ``python *argv``."""
    from procs import become_python

    for s in sockets:
        s.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    become_python(argv, cwd, env)


def warm_env(env: dict) -> dict:
    """``env`` with ``PYTHON_EXEC`` naming the warm shim (the server starts at the first call)."""
    global _SERVER
    if _SERVER is None:
        from procs import forkserver

        folder = tempfile.mkdtemp(prefix="warm_python_")
        path, shim = os.path.join(folder, "sock"), os.path.join(folder, "python")
        proc = forkserver().Process(target=_serve, args=(path,), daemon=True)
        proc.start()
        deadline = time.monotonic() + 120
        while not os.path.exists(path):  # bound by the server; a shim connecting before would fail
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the warm-python server did not start (exit code {proc.exitcode})")
            time.sleep(0.02)
        with open(shim, "w") as f:
            f.write(_SHIM.format(python=sys.executable, sock=path))
        os.chmod(shim, 0o755)
        atexit.register(proc.kill)
        _SERVER = (proc, path, shim)
    return {**env, "PYTHON_EXEC": _SERVER[2]}


def warm_command(cmd: list, env: dict) -> list:
    """``cmd``, a ``[sys.executable, ARGS...]`` command line, with the warm shim of ``env`` (`warm_env`'s result) as
    its interpreter."""
    assert cmd[0] == sys.executable, cmd
    return [env["PYTHON_EXEC"], *cmd[1:]]

