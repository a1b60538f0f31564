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


def main(argv: Optional[list] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(sys.argv[1:] if argv is None else argv)
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
