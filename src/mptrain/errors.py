"""The project's error types for what a user can fix (DESIGN.md §5), and how a rank reports one.

`train.py` catches `ConfigError` (a mistake in the config, found at start-up) and `StorageError`
(the storage the config points at fails at run time), prints the one-line message to stderr and
exits 1 without a traceback (`report_and_exit`). Raise a `ConfigError` on every rank *before* any
collective so that no rank hangs waiting.
"""

import os
import signal
import sys
import time
from typing import Any, NoReturn

CONFIG_ERROR_GRACE_S = 5.0
"""Seconds a rank that may be silent waits before exiting after a config error (`report_and_exit`)."""


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the key(s), the values and the fix."""


class StorageError(RuntimeError):
    """A run-time failure of the storage the user pointed us at (disk full, unwritable, corrupt).

    Not a `ConfigError`: the config was valid, the storage failed later (a sweep aborts on it instead
    of recording the job as rejected). One line naming the cause, the path and the fix, reported as a
    `ConfigError` is. ``all_ranks``: raised
    on every rank at the same point (a checkpoint save: every rank agrees first), so the process
    groups may be torn down and only rank 0 prints it; False when only the writing rank raises it
    (metrics.jsonl / train.log on rank 0): that rank exits and torchrun stops its peers.
    """

    def __init__(self, message: str, *, all_ranks: bool) -> None:
        super().__init__(message)
        self.all_ranks = all_ranks
        self.symmetric = all_ranks


def launch_rank_and_world(environ=None) -> tuple:
    """(rank, world size) from the launcher's variables: torchrun's ``RANK`` / ``WORLD_SIZE`` (when
    ``RANK`` is set, or no SLURM task id is), else SLURM's ``SLURM_PROCID`` / ``SLURM_NTASKS``;
    defaults (0, 1). The one place of that rule: `mptrain.groups.read_dist_env` builds on it, and
    an error report uses it alone (no torch import, no SLURM node-list lookup).

    Raises:
        ValueError: a variable that is not an integer.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    return int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", 1))


STORE_TIMEOUT_S = 2.0  # how long `_first_to_say` waits for the job's store before printing anyway


def _first_to_say(line: str) -> bool:
    """Whether this rank is the first of the job's attempt to report ``line`` (one print per distinct line:
    ranks that hit the same error while building, e.g. a component rejecting its config, say it once).

    Counted in the default process group's store where torchrun's agent hosts it
    (``TORCHELASTIC_USE_AGENT_STORE``): it outlives any worker, and the key names the attempt
    (``TORCHELASTIC_RESTART_COUNT``), so a restarted job reports again. True without such a store (a store a
    worker hosts may be gone with it), or when it does not answer within `STORE_TIMEOUT_S` (a second copy
    of a line beats a lost one)."""
    try:
        import datetime
        import hashlib

        import torch.distributed as dist

        if not dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return True
        store = dist.distributed_c10d._get_default_store()
        previous = store.timeout  # restored: the process may go on (a sweep's next job, a test's next task)
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            return store.add(f"mptrain/error_line/{attempt}/{hashlib.sha1(line.encode()).hexdigest()}", 1) == 1
        finally:
            store.set_timeout(previous)
    except Exception:  # noqa: BLE001 - no store, or one that is gone: print
        return True


def report_and_exit(line: str, *, rank: int, world_size: int, symmetric: bool,
                    grace_s: float = CONFIG_ERROR_GRACE_S) -> NoReturn:
    """Write ``line`` to stderr in one write and exit 1 (never returns).

    ``symmetric``: every rank hit the same error (the same config and world size), so rank 0 alone
    prints it; otherwise every rank that calls this prints its own (a line several ranks report, once:
    `_first_to_say`). Under torchrun
    (``world_size > 1``) the agent stops every worker (SIGTERM) as soon as one exits, so a rank
    that might still have a line to print must not be stopped by a peer's early exit: every rank
    waits ``grace_s`` before exiting (a SIGTERM meanwhile is an exit 1 too), except rank 0 of a
    symmetric error, which exits once it has printed (its peers hit the same error: nothing left to say).
    """
    if (rank == 0 or not symmetric) and (symmetric or _first_to_say(line)):
        sys.stderr.write(line.rstrip("\n") + "\n")
        sys.stderr.flush()
    if world_size > 1 and not (symmetric and rank == 0):
        signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
        time.sleep(grace_s)
    sys.exit(1)


def check_choice(key: str, value: Any, choices: tuple) -> None:
    """A closed Megatron choice (``model.normalization``): one line naming the key, the value and the options.

    Raises:
        ConfigError: `value` not in `choices`.
    """
    if value not in choices:
        valid = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{key}: unknown option {value!r}; valid: {valid}; set {key} to one of them")
