"""The project's error type for user mistakes (DESIGN.md §5).

`train.py` catches `ConfigError`, prints its one-line message to stderr and exits 1 without a
traceback. Raise it on every rank *before* any collective so that no rank hangs waiting.
"""


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the key(s), the values and the fix."""


class StorageError(ConfigError):
    """A run-time failure of the storage the user pointed us at (disk full, unwritable, corrupt).

    One line naming the cause, the path and the fix, like a `ConfigError`. ``all_ranks``: raised
    on every rank at the same point (a checkpoint save: every rank agrees first), so the process
    groups may be torn down and only rank 0 prints it; False when only the writing rank raises it
    (metrics.jsonl / train.log on rank 0): that rank exits and torchrun stops its peers.
    """

    def __init__(self, message: str, *, all_ranks: bool) -> None:
        super().__init__(message)
        self.all_ranks = all_ranks
        self.symmetric = all_ranks
