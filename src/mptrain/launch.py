"""`python -m mptrain.launch [torchrun options] train.py ...`: torchrun without its failure report.

torchrun (torch.distributed.run) answers any failed worker with a ~45-line ChildFailedError
traceback and report on stderr, which buries the one line our workers print for a user error
(README, "Quick start"). This entry point takes exactly torchrun's arguments and runs the same agent;
the only difference is what it prints when workers fail:

- the first failed worker exited with code 1: nothing (a worker of ours that exits 1 has already
  printed its own line: the one-line error, or `[rank r] job failed:` and its traceback; the
  peers torchrun then stops with SIGTERM are not news);
- any other first exit (a signal: SIGKILL by the OOM killer, a segfault): one line naming the
  rank, pid and exit code;
- the agent's per-process lines ("Sending process ... closing signal SIGTERM", "failed
  (exitcode: 1) local_rank: ...") are dropped unless LOGLEVEL is set.

Ctrl-C (SIGINT to the launcher, the workers or both, as a terminal sends it to all): the workers
finish their step, save when `checkpoint.save` is set, and rank 0 prints one line
(`mptrain.training.interrupt`); the launcher waits for them and adds nothing: no traceback of
its own, no report for the workers' exit code 130.

A stop signal's save gets time: torchrun's agent, on Ctrl-C or SIGTERM, signals the workers and sends them
SIGKILL ``--shutdown-timeout`` seconds later (torchrun's default: 30 s). A large model's step plus its save
takes longer, and a worker killed mid-save publishes no checkpoint and prints no line. Unless that option or
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is given, this launcher waits `STOP_SHUTDOWN_TIMEOUT_S`; a worker stuck in
its step still ends at its own grace timer (`mptrain.training.watchdog.StopSignal`). A torch whose torchrun
has no such option keeps its 30 s.

The exit status is torchrun's: 0 on success, 1 on any worker failure; 130 after Ctrl-C.
``--max-restarts`` and every other torchrun option behave as in torchrun.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional


INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # as `mptrain.training.interrupt` (not imported: no torch work here)
STOP_SHUTDOWN_TIMEOUT_S = 600  # seconds from a stop signal to the agent's SIGKILL: the step and its save


def with_stop_shutdown_timeout(args, environ=os.environ):
    """torchrun's parsed ``args`` with ``shutdown_timeout`` = `STOP_SHUTDOWN_TIMEOUT_S` where neither
    ``--shutdown-timeout`` nor ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` set it (module docstring); unchanged for a
    torchrun without the option. Returns ``args``."""
    if hasattr(args, "shutdown_timeout") and args.shutdown_timeout is None \
            and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in environ:
        args.shutdown_timeout = STOP_SHUTDOWN_TIMEOUT_S
    return args


def main(argv: Optional[list] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = with_stop_shutdown_timeout(get_args_parser().parse_args(sys.argv[1:] if argv is None else argv))
    if "LOGLEVEL" not in os.environ:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
        # "Received SIGINT death signal, shutting down workers": the workers' own line says what happened
        logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    try:
        run(args)
    except SignalException as err:
        # the agent forwarded the signal and waited for the workers (they finish the step and save)
        return INTERRUPTED_EXIT_CODE if err.sigval == signal.SIGINT else 128 + int(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C before the agent installed its handlers: no worker ran a step
        return INTERRUPTED_EXIT_CODE
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        if first.exitcode == INTERRUPTED_EXIT_CODE:
            return INTERRUPTED_EXIT_CODE  # the workers were stopped by Ctrl-C: rank 0 printed the line
        if first.exitcode != 1:
            sys.stderr.write(
                f"torchrun: {len(err.failures)} worker(s) failed; first: rank {rank} (pid {first.pid}), "
                f"exit code {first.exitcode}{f' ({first.signal_name()})' if first.exitcode < 0 else ''}\n"
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
