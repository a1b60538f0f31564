"""The project's error type for user mistakes (DESIGN.md §5).

`train.py` catches `ConfigError`, prints its one-line message to stderr and exits 1 without a
traceback. Raise it on every rank *before* any collective so that no rank hangs waiting.
"""


class ConfigError(ValueError):
    """A user-facing configuration error: one line naming the key(s), the values and the fix."""
