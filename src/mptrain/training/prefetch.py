"""Reading micro-batches ahead of the step on a CUDA rank (a data-loader worker thread, as torch's
``DataLoader(pin_memory=True)`` keeps one).

Why: on one GPU a small model's step is shorter than the host work around it. Reading the next
micro-batch (the provider, `check_batch`) then leaves the GPU idle, and a host→device copy from
pageable memory waits for the stream to drain before it starts (CUDA's rule for pageable copies),
so each micro-batch's copy also stalls the queue behind the previous micro-batch's backward. The
worker reads ``depth`` batches ahead and pins their tensors, so `get_batch`'s copies are
asynchronous and the reading overlaps the GPU's work. Order, values and errors are the
iterator's own: an exception the reader raises is raised by ``next`` at the same position.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional

import torch


def _pinned(batch):
    if not isinstance(batch, dict):
        return batch
    return {k: (v.pin_memory() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v) for k, v in batch.items()}


class PrefetchIterator:
    """``iterator``'s items, read up to ``depth`` ahead by a daemon thread (pinned when ``pin``).

    Args:
        iterator: yields micro-batch dicts of CPU tensors (``[b, s]``); consumed only by the thread.
        depth: items held ahead (each a micro-batch of host memory).
        pin: pin the tensors (needs CUDA) so that ``.to(device, non_blocking=True)`` is asynchronous.
    Raises (from ``next``): what the iterator raised, at the same position, then again on every call;
        StopIteration at its end.
    """

    def __init__(self, iterator: Iterator, *, depth: int = 2, pin: bool = True) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._pin = pin
        self._end: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True, name="mptrain-prefetch")
        self._thread.start()

    def _run(self, iterator: Iterator) -> None:
        try:
            for item in iterator:
                self._queue.put((_pinned(item) if self._pin else item, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put((None, exc))
            return
        self._queue.put((None, StopIteration()))

    def __iter__(self) -> "PrefetchIterator":
        return self

    def __next__(self):
        if self._end is not None:
            raise StopIteration if isinstance(self._end, StopIteration) else self._end
        item, exc = self._queue.get()
        if exc is not None:
            self._end = exc
            raise exc
        return item
