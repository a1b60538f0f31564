"""Console output of rank 0: on a terminal, a tqdm progress bar at the bottom with the log lines above it.

`run.progress_bar` (null = a bar only when stdout is a terminal) and `train.log_interval` (the
pacing) decide what is shown; metrics.jsonl and train.log get the same lines either way.

With a bar, every line (the paced step lines, evaluation, timers, warnings) is printed ABOVE the
bar with `tqdm.write`, which clears the bar, prints the line and redraws the bar, so the loss
history scrolls up like plain output while the bar stays on the last row; the bar itself shows
the position, the rate, the time left and the last loss. Without a bar (a pipe, a file, a batch
job) each line is printed as it is. Lines that belong to an iteration start with `iter N/T`.
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

            self.bar = tqdm(total=total_iters, initial=start_iteration, file=self.stream, unit="it",
                            dynamic_ncols=True, leave=True, desc="train")

    def message(self, text: str) -> None:
        """A line of its own (above the bar when there is one)."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def step(self, iteration: int, text: Optional[str] = None, *, postfix: Optional[str] = None) -> None:
        """Iteration `iteration` finished: print `text` (when given) and move the bar there.

        Args:
            text: the step line (printed above the bar, or plainly); None = only move the bar.
            postfix: short text shown on the bar itself (e.g. ``lm_loss=2.4713``).
        """
        if text is not None:
            self.message(text)
        if self.bar is not None:
            self.bar.update(max(0, iteration - self.bar.n))
            if postfix is not None:
                self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
