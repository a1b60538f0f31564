"""layout.json: per-rank facts gathered to rank 0, showing that the parallelism is real (DESIGN.md §2).

    {"world_size": 4, "ranks": [{"rank": 0, "tp": 0, "pp": 0, "dp": 0, "cp": 0, "vpp": null,
      "layers": [0, 1], "num_params": 12345, "param_dtype": "float16",
      "main_param_dtype": "float32", "optimizer_state_bytes": 98760, "schedule": "1f1b",
      "max_inflight_microbatches": 2, "bytes_sent": {"tp": 0, "pp": 0, "dp": 0, "embedding": 0},
      "samples_read": 8, "data_parallel_sharding_strategy": "no_shard", "param_bytes": 49380,
      "grad_bytes": 49380}, ...]}

Written once after set-up (what each rank holds) and rewritten at the end of the run with what
was observed (`bytes_sent` and `samples_read` per iteration, averaged over the run, via
`IterationCounters`). `layers` are global 0-based indices over all virtual chunks; `num_params`
counts local elements without vocab padding or the tied embedding's second copy (the model's
parameter-count function computes it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

LAYOUT_FILE = "layout.json"
BYTES_SENT_KINDS = ("tp", "pp", "dp", "embedding")


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """torch.float16 → "float16" (None stays None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside nested dicts / lists / tuples (e.g. an optimizer's `state`)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's per-parameter state on this rank (Adam: exp_avg + exp_avg_sq + step).

    Pass the inner torch optimizer of a mixed-precision / distributed wrapper; fp32 main params
    are not optimizer state here (they are reported through `main_param_dtype`).
    """
    return tensor_bytes(dict(optimizer.state))


def _compact(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(x)


@dataclasses.dataclass
class IterationCounters:
    """Per-rank totals over the run, turned into per-iteration averages for layout.json.

    The loop calls `add_bytes_sent` (or copies the schedule's `ScheduleStats.bytes_sent`),
    `add_samples_read` for every micro-batch this rank read from a dataset, `note_inflight`, and
    `end_iteration` once per iteration.
    """

    bytes_sent: dict = dataclasses.field(default_factory=lambda: {k: 0 for k in BYTES_SENT_KINDS})
    samples_read: int = 0
    iterations: int = 0
    microbatches: int = 0  # training micro-batches per DP rank, summed over the iterations
    max_inflight_microbatches: int = 0

    def add_bytes_sent(self, kind: str, nbytes: int) -> None:
        if kind not in BYTES_SENT_KINDS:
            raise ValueError(f"bytes_sent kind {kind!r} not in {BYTES_SENT_KINDS}")
        self.bytes_sent[kind] += int(nbytes)

    def add_samples_read(self, n: int) -> None:
        self.samples_read += int(n)

    def note_inflight(self, n: int) -> None:
        self.max_inflight_microbatches = max(self.max_inflight_microbatches, int(n))

    def end_iteration(self, num_microbatches: int = 0) -> None:
        """One more iteration, of ``num_microbatches`` micro-batches per DP rank."""
        self.iterations += 1
        self.microbatches += int(num_microbatches)

    def bytes_sent_per_iteration(self) -> dict:
        n = max(self.iterations, 1)
        return {k: _compact(self.bytes_sent.get(k, 0) / n) for k in BYTES_SENT_KINDS}

    def samples_read_per_iteration(self) -> float | int:
        return _compact(self.samples_read / max(self.iterations, 1))


@dataclasses.dataclass
class RankFacts:
    """One rank's entry in layout.json (field order = the JSON key order of DESIGN.md §2).

    Attributes:
        rank, tp, pp, dp, cp: global rank and its coordinates (cp: its context-parallel rank, 0 without CP).
        vpp: virtual pipeline size (None when not interleaved).
        layers: global indices of the transformer layers held (all virtual chunks), sorted.
        num_params: local parameter elements (padding and shared copies excluded).
        param_dtype: model parameter dtype ("float32", "bfloat16", "float16").
        main_param_dtype: optimizer master params dtype ("float32"), None when the optimizer steps
            the model params directly.
        optimizer_state_bytes: bytes of optimizer state on this rank.
        schedule: the schedule that ran.
        max_inflight_microbatches: most micro-batches whose activations were held at once.
        bytes_sent: bytes this rank sent per iteration, by group kind (tp, pp, dp, embedding).
        samples_read: samples this rank read from a dataset per iteration.
        data_parallel_sharding_strategy: the strategy that ran (no_shard | optim | optim_grads |
            optim_grads_params; `mptrain.distributed.strategy`).
        param_bytes, grad_bytes: bytes of this rank's model params and grads (ZeRO-2 / ZeRO-3: its shards;
            `mptrain.distributed.held_bytes`).
    """

    rank: int
    tp: int
    pp: int
    dp: int
    # keyword-only, so positional construction keeps its order; JSON order still puts it beside dp
    cp: int = dataclasses.field(default=0, kw_only=True)
    vpp: Optional[int]
    layers: list
    num_params: int
    param_dtype: str
    main_param_dtype: Optional[str]
    optimizer_state_bytes: int
    schedule: str
    max_inflight_microbatches: int
    bytes_sent: dict
    samples_read: float | int
    data_parallel_sharding_strategy: str = "no_shard"
    param_bytes: int = 0
    grad_bytes: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.bytes_sent) - set(BYTES_SENT_KINDS)
        if unknown:
            raise ValueError(f"bytes_sent kinds {sorted(unknown)} not in {BYTES_SENT_KINDS}")
        self.bytes_sent = {k: self.bytes_sent.get(k, 0) for k in BYTES_SENT_KINDS}
        self.layers = sorted(int(i) for i in self.layers)

    @classmethod
    def build(
        cls,
        groups: Any,
        *,
        layers: Iterable[int],
        num_params: int,
        param_dtype: torch.dtype,
        main_param_dtype: Optional[torch.dtype],
        optimizer_state_bytes: int,
        schedule: str,
        counters: IterationCounters,
        data_parallel_sharding_strategy: str = "no_shard",
        param_bytes: int = 0,
        grad_bytes: int = 0,
    ) -> "RankFacts":
        """From a `ParallelGroups` (coordinates) and the run's counters."""
        return cls(
            rank=groups.rank,
            tp=groups.tp_rank,
            pp=groups.pp_rank,
            dp=groups.dp_rank,
            cp=groups.cp_rank,
            vpp=groups.vpp_size,
            layers=list(layers),
            num_params=int(num_params),
            param_dtype=dtype_name(param_dtype),
            main_param_dtype=dtype_name(main_param_dtype),
            optimizer_state_bytes=int(optimizer_state_bytes),
            schedule=schedule,
            max_inflight_microbatches=counters.max_inflight_microbatches,
            bytes_sent=counters.bytes_sent_per_iteration(),
            samples_read=counters.samples_read_per_iteration(),
            data_parallel_sharding_strategy=data_parallel_sharding_strategy,
            param_bytes=int(param_bytes),
            grad_bytes=int(grad_bytes),
        )


def _torch_gather(obj: Any) -> Optional[list]:
    import torch.distributed as dist

    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def gather_layout(
    facts: RankFacts, *, rank: int, world_size: int, gather_object: Optional[Callable[[Any], Optional[list]]] = None
) -> Optional[dict]:
    """Gather every rank's facts to rank 0 (collective over the default group).

    Args:
        facts: this rank's entry.
        rank, world_size: this process in the default group.
        gather_object: `f(obj) -> list by rank` on rank 0 (None elsewhere); None = torch.distributed's
            `gather_object` (identity for a world of 1).
    Returns:
        on rank 0 {"world_size", "ranks": [entry of rank 0, 1, ...]}; None on other ranks.
    """
    if gather_object is None:
        gather_object = (lambda obj: [obj]) if world_size == 1 else _torch_gather
    entries = gather_object(dataclasses.asdict(facts))
    if rank != 0:
        return None
    entries = sorted(entries, key=lambda e: e["rank"])
    if [e["rank"] for e in entries] != list(range(world_size)):
        raise RuntimeError(f"layout gather: expected ranks 0..{world_size - 1}, got {[e['rank'] for e in entries]}")
    return {"world_size": world_size, "ranks": entries}


def write_layout(run_dir: str | os.PathLike, layout: dict) -> Path:
    """Write (or rewrite) `<run_dir>/layout.json` atomically (rank 0)."""
    path = Path(run_dir) / LAYOUT_FILE
    tmp = path.with_name(LAYOUT_FILE + ".tmp")
    tmp.write_text(json.dumps(layout, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def gather_and_write_layout(run_dir: str | os.PathLike, facts: RankFacts, *, rank: int, world_size: int) -> Optional[dict]:
    """`gather_layout` then `write_layout` on rank 0 (collective). Returns the layout on rank 0."""
    layout = gather_layout(facts, rank=rank, world_size=world_size)
    if layout is not None:
        write_layout(run_dir, layout)
    return layout
