"""Micro-batches prepared ahead of the step that uses them (the reading rank's side of `get_batch`).

On CUDA a background thread takes the next micro-batches from the (checked) data iterator, packs them on
the host, pins them and copies them to the device on a side stream while the previous steps run; the
step then only waits for that copy on its own stream (an event, no host sync). Elsewhere the same object
prepares each batch when it is asked for (no thread), so CPU runs compute exactly what they did.

The order of the batches is the iterator's: prefetching reads ahead, never skips or reorders, so resume
(a fresh iterator from the checkpoint's consumed samples) continues the same stream. An exception of the
iterator (a bad batch, a provider raising) is raised to the step that asks for that batch, as without a
prefetcher. Source: the pinned, non-blocking, side-stream copy of torch's ``DataLoader(pin_memory=True)``
plus a prefetch stream (torchtitan / NVIDIA's DALI ``prefetch_queue_depth``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, Optional

import torch

_END = object()


class _Failed:
    """What the iterator raised, kept for the step that asks for that batch."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class PreparedBatch:
    """One micro-batch already on the device: ``tensors`` (name -> tensor or None), ``samples`` (its b).

    ``ready``: the side stream's event after the copy (CUDA with a prefetch thread), else None;
    `wait` makes the current stream wait for it (no host sync) and marks the tensors as used there.
    """

    def __init__(self, tensors: dict, samples: int, ready: Optional[torch.cuda.Event] = None) -> None:
        self.tensors, self.samples, self.ready = tensors, samples, ready

    def wait(self) -> None:
        if self.ready is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.ready)
        for t in self.tensors.values():
            if t is not None:
                t.record_stream(stream)  # allocated on the side stream, used on this one
        self.ready = None


def _produce(batches: Iterator, prepare: Callable[[Any], PreparedBatch], out: queue.Queue, stop: threading.Event,
             device: torch.device) -> None:
    """The prefetch thread: prepare batches on a side stream into ``out`` until the iterator ends or fails,
    or ``stop`` is set. Holds no reference to the `BatchPrefetcher` (which stops it when collected)."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    try:
                        prepared = prepare(next(batches))
                    except StopIteration:
                        put(_END)
                        return
                    prepared.ready = torch.cuda.Event()
                    prepared.ready.record(stream)
                    if not put(prepared):
                        return
    except BaseException as exc:  # noqa: BLE001 - raised to the step that asks for this batch, whatever it is
        put(_Failed(exc))


class BatchPrefetcher:
    """An iterator of `PreparedBatch` over an iterator of host micro-batches (module docstring).

    Args:
        batches: the checked host micro-batches (dicts, `mptrain.training.batch.check_batch`).
        prepare: host batch -> `PreparedBatch` on ``device`` (`mptrain.training.batch.prepare_batch`).
        device: where the batches go; a thread prefetches only for CUDA devices with ``depth > 0``.
        depth: micro-batches prepared ahead (0: each is prepared when asked for).
        on_take: called with each batch's sample count when the step takes it (training's ``samples_read``).
    """

    def __init__(self, batches: Iterator, prepare: Callable[[Any], PreparedBatch], *, device: torch.device,
                 depth: int = 2, on_take: Optional[Callable[[int], None]] = None) -> None:
        self._batches, self._prepare, self._on_take = iter(batches), prepare, on_take
        self._thread: Optional[threading.Thread] = None
        if torch.device(device).type == "cuda" and depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            # started lazily: the first batch is asked for after the start-up work (checkpoint load, eval)
            self._start = lambda: threading.Thread(
                target=_produce, args=(self._batches, prepare, self._queue, self._stop, torch.device(device)),
                name="mptrain-batch-prefetch", daemon=True)

    def __iter__(self) -> "BatchPrefetcher":
        return self

    def __next__(self) -> PreparedBatch:
        if not hasattr(self, "_queue"):
            prepared = self._prepare(next(self._batches))  # the iterator's exceptions propagate as they are
        else:
            if self._thread is None:
                self._thread = self._start()
                self._thread.start()
            item = self._get()
            if item is _END:
                self._queue.put(_END)  # every later call ends too
                raise StopIteration
            if isinstance(item, _Failed):
                self._queue.put(item)
                raise item.error
            prepared = item
        if self._on_take is not None:
            self._on_take(prepared.samples)
        prepared.wait()
        return prepared

    def _get(self):
        """The next item; waits only while the thread has not caught up (reading is slower than a step)."""
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # it ended without a word: never hang
                    raise RuntimeError("the batch prefetch thread ended without a batch or an error") from None

    def close(self) -> None:
        """Stop the prefetch thread (it ends within 0.1 s); no-op without one."""
        if hasattr(self, "_stop"):
            self._stop.set()

    def __del__(self) -> None:
        self.close()


def close_prefetchers(iterators: list) -> None:
    """`BatchPrefetcher.close` each of ``iterators`` that is one (None and plain iterators are left alone)."""
    for it in iterators:
        if isinstance(it, BatchPrefetcher):
            it.close()
