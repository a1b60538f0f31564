"""Adding a micro-batch's small fp16/bf16 grads into their fp32 ``main_grad`` views in two launches.

A mixed-dtype ``torch._foreach_add_`` (fp32 views, bf16 grads) leaves torch's multi-tensor path for
one kernel per tensor (one launch per bias and norm weight per micro-batch), several times the
device time of what `StagedAdd` does (bench/reports/2026-12-01-micro-benchmarks.md): cast the grads into a persistent fp32 staging buffer with one
``_foreach_copy_`` (it is
multi-tensor across dtypes; bf16/fp16 -> fp32 is exact), then one same-dtype ``_foreach_add_``. The
sums are bitwise those of the mixed-dtype add (``main_grad + float(grad)`` rounded once to fp32;
`tests/test_host_overhead.py`).

Large grads are left to one plain ``add_`` (the DDP hook): for the word embedding's ``[V_pad, h]``
lookup grad the mixed add runs near HBM bandwidth, and casting first is slower.
"""

from __future__ import annotations

import torch


class StagedAdd:
    """Queue (main grad view, grad) pairs; `flush` adds them all with two multi-tensor launches.

    Args:
        sizes: {key: numel} of every tensor that may be queued (a param's slot); the staging buffer
            (``sum(sizes)`` elements of the main grads' ``dtype``) is allocated on the first flush of
            narrower grads.
        dtype, device: those of the main grads.
    Staging is used only for grads narrower than the main grads (bf16/fp16 into fp32: the cast is
    exact, so the sums are bitwise the mixed add's); same-dtype grads go straight to one
    ``_foreach_add_`` (already multi-tensor).
    """

    def __init__(self, sizes: dict, *, dtype: torch.dtype, device: torch.device) -> None:
        self._offsets: dict = {}
        total = 0
        for key, n in sizes.items():
            self._offsets[key] = (total, int(n))
            total += int(n)
        self._total, self._dtype, self._device = total, dtype, device
        self._staging = None
        self._staged: dict = {}  # key -> its staging view (made once, shaped like its main grad)
        self.views: list = []
        self.grads: list = []
        self._keys: list = []
        self._queued: set = set()

    def queue(self, key, view: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` into ``view`` at the next `flush` (``key``: one of ``sizes``).

        A key already queued (a second grad of the same param before a flush: autograd does not do
        that within one backward) is added at once instead: its one staging slot holds one grad."""
        if key in self._queued:
            with torch.no_grad():
                view.add_(grad)
            return
        self._queued.add(key)
        self.views.append(view)
        self.grads.append(grad)
        self._keys.append(key)

    def __len__(self) -> int:
        return len(self.views)

    def clear(self) -> None:
        """Drop what is queued (a backward that raised)."""
        self.views.clear()
        self.grads.clear()
        self._keys.clear()
        self._queued.clear()

    def _staged_view(self, key, view: torch.Tensor) -> torch.Tensor:
        staged = self._staged.get(key)
        if staged is None:
            if self._staging is None:
                self._staging = torch.empty(self._total, dtype=self._dtype, device=self._device)
            lo, n = self._offsets[key]
            staged = self._staged[key] = self._staging[lo:lo + n].view_as(view)
        return staged

    @torch.no_grad()
    def flush(self) -> None:
        """``view += grad`` for every queued pair, then clear the queue."""
        if not self.views:
            return
        same = all(g.dtype == self._dtype for g in self.grads)
        if same or any(torch.promote_types(g.dtype, self._dtype) != self._dtype for g in self.grads):
            # same dtype: already multi-tensor; a grad wider than the main grads: casting it first would
            # round twice, so the one mixed-dtype add (one rounding) stays
            torch._foreach_add_(self.views, self.grads)
        else:
            staged = [self._staged_view(k, v) for k, v in zip(self._keys, self.views)]
            torch._foreach_copy_(staged, self.grads)  # the exact cast, one multi-tensor launch
            torch._foreach_add_(self.views, staged)
        self.clear()
