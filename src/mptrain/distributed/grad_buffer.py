"""Contiguous grad buffer: one flat tensor per grad dtype, split into buckets (Megatron's `_ParamAndGradBuffer`).

Layout (Megatron ``distributed/param_and_grad_buffer.py``; design document §4.1 "main_grad")::

    params in REVERSE registration order (≈ the order backward produces their grads)
    buffer  [ p_n | p_n-1 | ... | p_k ][pad] [ tied embedding ][pad] [ p_j | ... | p_1 ][pad]
            '------ bucket 0 ----------'    '--- bucket 1 ---'      '----- bucket 2 -----'

* Each parameter's ``main_grad`` is a view ``data[start:end].view(shape)`` of the buffer. The
  param -> (start, end, bucket) map lives in this object only (`ParamSlot`), never on the param.
* A bucket closes once it holds >= ``bucket_size`` elements. The tied word embedding (and its
  last-stage copy) gets a bucket of its own (megatron/core/distributed/finalize_model_grads.py): its grad is
  all-reduced over
  the embedding group *after* the DP reduce-scatter, which is only right when both stages shard it
  identically over DP.
* With the distributed optimizer every bucket is padded to a multiple of the DP size so that each
  DP rank owns the contiguous range ``[start + r·n/dp, start + (r+1)·n/dp)`` of it (ZeRO-1).
  Padding elements stay zero and belong to no parameter.

Units: every offset and size here is in ELEMENTS of the buffer's dtype, not bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

DEFAULT_BUCKET_MIN = 40_000_000
DEFAULT_BUCKET_PER_DP = 1_000_000


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default bucket size in elements: max(40M, 1M × dp)."""
    return max(DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_DP * dp_size)


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's grad lives: buffer elements [start, end) inside bucket ``bucket``."""

    name: str
    start: int
    end: int
    bucket: int
    shape: tuple


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Buffer elements [start, end) (end - start divisible by dp when padded) and their params' names."""

    index: int
    start: int
    end: int
    param_names: tuple

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """Buffer range [lo, hi) owned by ``dp_rank`` (ZeRO-1). Needs numel % dp_size == 0."""
        assert self.numel % dp_size == 0, (self.numel, dp_size)
        size = self.numel // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


class GradBuffer:
    """One contiguous grad buffer for params sharing a grad dtype, with its bucket layout.

    Args:
        named_params: [(name, param)] in module registration order (reversed internally).
        dtype: grad dtype of the buffer (fp32 under ``grad_reduce_in_fp32``, else the param dtype).
        bucket_size: elements per bucket before it closes; None = `default_bucket_size(dp_size)`.
        dp_size: data-parallel size (padding granularity when ``pad_for_dp``).
        pad_for_dp: pad every bucket to a multiple of ``dp_size`` (distributed optimizer).
        own_bucket: names of params that must sit alone in a bucket (the tied embedding).
        device: where the buffer lives.
        expert: the buffer holds expert-parallel weights (`ShardSpec.expert_parallel`); ``dp_size`` is then the
            expert-data-parallel size (`reduction`).
    Raises:
        ValueError: bucket_size < 1.
    """

    def __init__(
        self,
        named_params: list,
        *,
        dtype: torch.dtype,
        bucket_size: Optional[int],
        dp_size: int,
        pad_for_dp: bool,
        own_bucket: frozenset = frozenset(),
        device: torch.device = torch.device("cpu"),
        expert: bool = False,
    ) -> None:
        if bucket_size is None:
            bucket_size = default_bucket_size(dp_size)
        if bucket_size < 1:
            raise ValueError(f"parallel.bucket_size={bucket_size} must be >= 1 element (or null for the default)")
        self.dtype = dtype
        self.dp_size = dp_size
        self.expert = expert
        self._slots: dict = {}  # param (hashed by identity) -> ParamSlot
        self._params_by_name: dict = {}
        buckets: list = []
        cursor, bucket_start, names = 0, 0, []

        def close() -> None:
            nonlocal cursor, bucket_start, names
            if not names:
                return
            if pad_for_dp:
                cursor += (-(cursor - bucket_start)) % dp_size
            buckets.append(Bucket(len(buckets), bucket_start, cursor, tuple(names)))
            bucket_start, names = cursor, []

        for name, param in reversed(named_params):
            alone = name in own_bucket
            if alone:
                close()
            self._slots[param] = ParamSlot(name, cursor, cursor + param.numel(), len(buckets), tuple(param.shape))
            self._params_by_name[name] = param
            cursor += param.numel()
            names.append(name)
            if alone or cursor - bucket_start >= bucket_size:
                close()
        close()
        self.buckets: tuple = tuple(buckets)
        self.numel = cursor
        self.data = torch.zeros(cursor, dtype=dtype, device=device)
        # the views, made once (the optimizer asks for every param's each step; `data` is never replaced)
        self._views: dict = {p: self.data[s.start : s.end].view(s.shape) for p, s in self._slots.items()}

    def reduction(self, groups) -> tuple:
        """(group, rank, size) this buffer's grads are reduced (and ZeRO-1-sharded) over: the expert-data-parallel
        group for expert-parallel weights (Megatron's separate expert buffers), else the data-parallel-with-context
        group dp × cp (the CP ranks replicate every weight; = the data-parallel group at cp = 1)."""
        if self.expert:
            return groups.edp_group, groups.edp_rank, groups.edp_size
        return groups.dp_cp_group, groups.dp_cp_rank, groups.dp_cp_size

    # --- lookups ---------------------------------------------------------------------------
    def __contains__(self, param: torch.Tensor) -> bool:
        return param in self._slots

    def slot(self, param: torch.Tensor) -> ParamSlot:
        return self._slots[param]

    def param(self, name: str) -> torch.nn.Parameter:
        return self._params_by_name[name]

    def params(self) -> list:
        """Params in buffer order (reverse registration order)."""
        return list(self._slots)

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The param's grad as a view of the buffer, shaped like the param (the same view object each call)."""
        return self._views[param]

    def bucket_data(self, bucket: Bucket) -> torch.Tensor:
        return self.data[bucket.start : bucket.end]

    def bucket_params(self, bucket: Bucket) -> list:
        return [self._params_by_name[n] for n in bucket.param_names]
