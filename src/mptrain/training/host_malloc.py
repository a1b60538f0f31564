"""glibc malloc settings for training steps on the CPU (``run.cpu_malloc_tuning``, off by default).

A CPU step allocates and frees the same activations every iteration, several MB each. glibc's
default malloc returns the freed top of its heap to the OS once it exceeds ``M_TRIM_THRESHOLD``
(and serves blocks above ``M_MMAP_THRESHOLD`` with fresh ``mmap``s); both thresholds move with
the sizes freed so far, so whether a given process trims every step depends on its allocation
history. A process that trims re-grows its heap in the next step's forward, page fault by page
fault. Fixing both thresholds keeps the peak a step reaches mapped, so the next step reuses it.
Values are unchanged (only where memory comes from); the cost is that up to ``trim_threshold`` of
freed heap stays with the process instead of going back to the OS between steps.

Nothing is changed when the user already chose: any ``MALLOC_*_`` threshold variable or a malloc
``GLIBC_TUNABLES`` entry in the environment, or another allocator preloaded (jemalloc, tcmalloc,
mimalloc); nor off Linux / glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 1 << 30
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def user_chose_allocator(environ=os.environ) -> bool:
    """The environment already sets glibc's malloc thresholds or preloads another allocator."""
    if any(k in environ for k in _USER_ENV) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return True
    return any(name in environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS)


def tune_cpu_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (module docstring); idempotent.

    Returns True when both were set; False when skipped (not Linux, not glibc, the user's own
    choice in the environment) or glibc refused.
    """
    if not sys.platform.startswith("linux") or user_chose_allocator():
        return False
    try:
        libc = ctypes.CDLL(None)
        _ = libc.gnu_get_libc_version  # glibc only (musl has no mallopt thresholds)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1 and mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1
