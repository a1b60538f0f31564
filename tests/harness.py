"""Run a function on N gloo processes on CPU: a persistent pool per world size.

Importing torch in 8 processes costs ~8 s on a 2-core machine, so each world size keeps one
pool of worker processes alive across tests (`run_distributed`), forked from the forkserver of
tests/procs.py that imported torch, Hydra and mptrain once, until its workers hold too many
leaked threads (`_RECYCLE_THREADS`). Every worker has joined one
default gloo group of that size; a task is a picklable, module-level function
``fn(rank, world_size, *args) -> result`` that every worker runs. Results come back as a list
indexed by rank.

Failure handling: if any rank raises, the others usually block in a collective, so after the
first error the pool waits a short grace period, then kills the workers (the next call starts a
fresh pool) and raises `DistributedTestError` carrying the failing rank's traceback. A task that
runs past ``timeout_s`` is treated the same way (a hang guard, not a speed assertion).

Tasks must leave no process groups behind (use try/finally with ``groups.destroy()``).

Stale code: a worker imports modules lazily and keeps them for the whole test run, so a source file
edited while a long run is going (a shared working tree) leaves workers running the old code while
tracebacks print the new file's lines. A failure report lists the repository sources loaded in the
failing process that changed on disk after it started (`_changed_sources`): rerun before debugging.
"""

from __future__ import annotations

import atexit
import gc
import os
import queue
import socket
import sys
import time
import traceback

_POOLS: dict = {}
_GRACE_S = 5.0
# Suite time: a job that leaves process groups alive (a ZeRO-2/3 job: ~3 threads per world-2 worker; every
# training job left ~15 until the end of a run released DDP's grad hooks) keeps their `gloo_tcp_loop` /
# `pt_gloo_runloop` threads (a bare new_group + all_reduce + destroy_process_group leaves none), and the idle `gloo_tcp_loop` threads
# keep waking up: a worker idling with ~680 threads used 0.25 of a core, ~300 threads 0.09, ~150
# 0.04. In a full suite run the pools' workers reached ~700 threads each (the 4-rank pool alone
# then drains about a core, even while idle): load average 30-200 and tests 2-5x slower than alone.
# A pool whose worker holds more than this many threads is closed after its task; the next call
# starts a fresh one (~0.2 CPU-s a rank). At 40 (a job or two) the pools of a two-file run idled at 0.08 of a
# core where 150 gave 0.39.
_RECYCLE_THREADS = 40


class DistributedTestError(AssertionError):
    """A rank raised (or the task timed out); the message holds the rank's traceback."""


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STARTED = time.time()  # this process's start (under pytest: the test run's)


def _changed_sources(since: float, where: str) -> str:
    """A note naming the repository modules loaded in this process (``where``) whose file changed after ``since``."""
    changed = []
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None) or ""
        if path.startswith(_REPO + os.sep) and "site-packages" not in path:
            try:
                if os.stat(path).st_mtime > since:
                    changed.append(os.path.relpath(path, _REPO))
            except OSError:
                continue
    if not changed:
        return ""
    return (f"\nNOTE ({where}): changed on disk after this process started, so it may be running older code "
            f"than the traceback's source lines show; rerun before debugging: {', '.join(sorted(changed))}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, env: dict, cwd: str, started: float) -> None:
    # forked from the preloaded forkserver: take the environment and folder the pool's creator had, as a
    # spawned interpreter would (the forkserver holds those of its own start)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    global _STARTED
    _STARTED = started  # stale-code check: the forkserver imported the repository's modules after this
    os.environ.update(
        {
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
        }
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            out = fn(rank, world_size, *args, **kwargs)
            results.put((task_id, rank, True, out))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            note = _changed_sources(_STARTED, f"worker rank {rank}")
            results.put((task_id, rank, False, traceback.format_exc() + note))
        # suite time: what outlived the task (modules, caches) is long-lived; the cyclic GC stops
        # re-traversing it at every full collection (~15 % of a worker's CPU otherwise). The task's
        # cyclic garbage is collected first (frozen, it would never be freed).
        gc.collect()
        gc.freeze()
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int) -> None:
        # Suite time: the workers are forked from `procs`' forkserver, which imported torch, Dynamo, Hydra and
        # mptrain once; a spawned worker paid those imports itself (~3-6 s of CPU per worker on 2 cores, at
        # every pool start and recycle).
        from procs import _context

        ctx = _context()
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = _free_port()
        env, cwd = dict(os.environ), os.getcwd()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results, env, cwd, _STARTED),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.next_id = 0

    def run(self, fn, args, kwargs, timeout_s: float):
        task_id = self.next_id
        self.next_id += 1
        for q in self.tasks:
            q.put((task_id, fn, args, kwargs))
        out = [None] * self.world_size
        errors: dict = {}
        pending = set(range(self.world_size))
        import time

        deadline = time.monotonic() + timeout_s
        while pending:
            wait = deadline - time.monotonic()
            if errors:
                wait = min(wait, _GRACE_S)
            if wait <= 0:
                break
            try:
                tid, rank, ok, value = self.results.get(timeout=wait)
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs) and not errors:
                    errors[-1] = "a worker process died (killed or crashed)"
                break
            if tid != task_id:
                continue
            pending.discard(rank)
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
        if errors or pending:
            self.kill()
            if errors:
                rank = min(errors)
                raise DistributedTestError(
                    f"rank {rank} of {self.world_size} failed in {fn.__name__} (ranks that failed: {sorted(errors)}; "
                    f"still running: {sorted(pending)}):\n{errors[rank]}{_changed_sources(_STARTED, 'pytest process')}"
                )
            raise DistributedTestError(f"{fn.__name__} timed out after {timeout_s} s on ranks {sorted(pending)}")
        return out

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def max_threads(self) -> int:
        """The largest thread count of a worker (Linux /proc; 0 where it cannot be read)."""
        counts = [0]
        for p in self.procs:
            try:
                counts.append(len(os.listdir(f"/proc/{p.pid}/task")))
            except OSError:
                continue
        return max(counts)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        _POOLS.pop(self.world_size, None)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 180.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of a gloo world; return results by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message) or the task hung.
    """
    in_parent = getattr(fn, "in_parent", None)  # work every rank would repeat, done once here (`train_utils.run_job`)
    if in_parent is not None:
        args = in_parent(*args)
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _Pool(world_size)
        _POOLS[world_size] = pool
    out = pool.run(fn, args, kwargs, timeout_s)
    if pool.max_threads() > _RECYCLE_THREADS:  # leaked gloo threads (see _RECYCLE_THREADS)
        pool.close()
    return out


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
