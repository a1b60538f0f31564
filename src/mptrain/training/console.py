"""Console output of rank 0: a tqdm progress bar on interactive terminals, plain lines otherwise.

`train.log_interval` paces only this (metrics.jsonl gets every iteration). With a bar, each paced
iteration updates the bar's position and its postfix (the step line); messages (evaluation,
timers, warnings) are printed above the bar with `tqdm.write` so the bar is not torn. Without a bar
(a pipe, a file, a batch job), each paced iteration prints one plain line.
"""

from __future__ import annotations

import sys
from typing import IO, Any, Optional


def is_interactive(stream: Any) -> bool:
    """True when `stream` is a terminal (`isatty`)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # closed or detached stream
        return False


class Console:
    """Rank 0's console.

    Args:
        stream: where to write (default sys.stdout).
        progress_bar: True = a bar, False = plain lines, None = a bar only when `stream` is a terminal.
        total_iters: the last iteration (`train.train_iters`), the bar's total.
        start_iteration: iterations already done (resume), the bar's start.
    """

    def __init__(
        self,
        stream: Optional[IO] = None,
        *,
        progress_bar: Optional[bool] = None,
        total_iters: Optional[int] = None,
        start_iteration: int = 0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        use_bar = is_interactive(self.stream) if progress_bar is None else progress_bar
        self.bar = None
        if use_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_iters, initial=start_iteration, file=self.stream, unit="it", dynamic_ncols=True, leave=True
            )

    def message(self, text: str) -> None:
        """A line of its own (above the bar when there is one)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def step(self, iteration: int, text: str) -> None:
        """Iteration `iteration` finished: move the bar there with `text` as postfix, or print `text`."""
        if self.bar is not None:
            self.bar.update(max(0, iteration - self.bar.n))
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
