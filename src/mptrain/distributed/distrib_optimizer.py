"""ZeRO-1 distributed optimizer: fp32 main params and optimizer state only for this DP rank's shard.

Megatron-LM ``megatron/core/optimizer/distrib_optimizer.py``, on top of
our `GradBuffer` layout (buckets padded to a multiple of dp, grad_buffer.py):

    bucket b, elements [start, end), n = end - start, dp ranks r = 0..dp-1
    rank r owns  [start + r·n/dp, start + (r+1)·n/dp)        ("shard")
    a param's piece on rank r = its slot ∩ the shard          (at most one contiguous piece per param)

One iteration:
1. DDP reduce-scatters each bucket (SUM): the shard now holds the DP-summed grad; finalize scales it.
2. `step`: main grads = the shard's buffer elements (fp32 view, or an fp32 copy of bf16/fp16
   grads) → unscale by 1/S and look for inf/nan → found_inf MAX-reduced over DP then MP (every
   rank of the world agrees) → grad norm over the pieces that count (`ShardSpec.counts_on`),
   SUM-reduced over DP then MP (each distinct element once: pieces tile each param across DP) →
   clip → inner optimizer step on the fp32 pieces → write the pieces into a bucket-sized scratch
   (param dtype values) → all-gather over DP → copy every param of the bucket from the scratch.
A skipped step (found_inf) changes nothing and gathers nothing.

Memory: main params + Adam's exp_avg/exp_avg_sq are 12 bytes per owned element, i.e. ≈ 12·N/dp
bytes per rank instead of 12·N (`optimizer_state_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from mptrain.precision.optimizer import MainParamEntry, OptimizerWrapper, StepResult

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["DistributedOptimizer", "ShardEntry", "StepResult"]


@dataclasses.dataclass
class ShardEntry(MainParamEntry):
    """This rank's contiguous piece of one model param: param elements [lo, hi) (flattened) =
    buffer elements [buf_lo, buf_lo + hi - lo) inside ``bucket`` of ``buffer``; ``main`` is fp32 [hi - lo]."""

    chunk: int
    name: str
    buffer: object
    bucket: object
    lo: int
    hi: int
    buf_lo: int


class DistributedOptimizer(OptimizerWrapper):
    """ZeRO-1 over the DP group; `OptimizerWrapper`'s step / interface with sharded main params.

    Args:
        build_optimizer: ``param_groups -> torch.optim.Optimizer`` (`mptrain.optim.build_optimizer_factory`).
        model_chunks: this rank's `DistributedDataParallel` chunks built with ``use_distributed_optimizer=True``.
        groups: `ParallelGroups`.
        scaler, clip_grad, max_consecutive_skips, log_num_zeros: as `OptimizerWrapper`.
    Raises:
        ValueError: a chunk was not built for the distributed optimizer.
    """

    def __init__(
        self,
        build_optimizer: Callable,
        model_chunks: list,
        groups,
        *,
        scaler=None,
        clip_grad: float = 0.0,
        max_consecutive_skips: int = 0,
        log_num_zeros: bool = False,
    ) -> None:
        for i, chunk in enumerate(model_chunks):
            if not chunk.use_distributed_optimizer:
                raise ValueError(
                    f"DistributedOptimizer: model chunk {i} was wrapped with use_distributed_optimizer=False; "
                    "build DistributedDataParallel with parallel.use_distributed_optimizer=true"
                )
        self.model_chunks = list(model_chunks)  # needed by _build_entries, which the base __init__ calls
        params, specs = [], []
        for chunk in self.model_chunks:
            for name, param, _ in chunk.named_main_grads():
                params.append(param)
                specs.append(chunk.specs[name])
        super().__init__(
            build_optimizer,
            params,
            specs,
            None,
            groups,
            scaler=scaler,
            clip_grad=clip_grad,
            max_consecutive_skips=max_consecutive_skips,
            log_num_zeros=log_num_zeros,
        )

    # --- hooks of OptimizerWrapper ---------------------------------------------------------
    def _build_entries(self, params: list, specs: list) -> list:
        """One `ShardEntry` per param that intersects this rank's shard of its bucket (buffer order)."""
        g = self.groups
        entries = []
        for ci, chunk in enumerate(self.model_chunks):
            for buf in chunk.buffers:
                for bucket in buf.buckets:
                    s_lo, s_hi = bucket.shard_range(g.dp_rank, g.dp_size)
                    for param in buf.bucket_params(bucket):
                        slot = buf.slot(param)
                        b_lo, b_hi = max(slot.start, s_lo), min(slot.end, s_hi)
                        if b_lo >= b_hi:
                            continue
                        lo, hi = b_lo - slot.start, b_hi - slot.start
                        main = torch.nn.Parameter(param.detach().reshape(-1)[lo:hi].to(torch.float32).clone())
                        entries.append(
                            ShardEntry(param, chunk.specs[slot.name], main, ci, slot.name, buf, bucket, lo, hi, b_lo)
                        )
        return entries

    def _grad_stats_groups(self) -> list:
        # DP shards differ: SUM over DP (the pieces of one replica) then over MP (TP x PP).
        return [self.groups.dp_group, self.groups.mp_group]

    def _copy_model_grads_to_main_grads(self) -> None:
        for e in self.entries:
            view = e.buffer.data[e.buf_lo : e.buf_lo + e.hi - e.lo]
            # .float() aliases the fp32 buffer (unscale/clip then act in place, as Megatron) and copies fp16/bf16.
            e.main.grad = view.float()

    @torch.no_grad()
    def _copy_model_params_to_main_params(self) -> None:
        for e in self.entries:
            e.main.copy_(e.model_param.detach().reshape(-1)[e.lo : e.hi])

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        """Write the updated pieces into per-bucket scratch, all-gather over DP, copy into the model params."""
        by_bucket: dict = {}
        for e in self.entries:
            by_bucket.setdefault((id(e.buffer), e.bucket.index), []).append(e)
        g = self.groups
        for chunk in self.model_chunks:
            for buf in chunk.buffers:
                for bucket in buf.buckets:
                    # Scratch in the buffer's dtype: the param dtype, or fp32 (which holds any
                    # fp16/bf16 value exactly), so every param gets its own dtype's rounding.
                    scratch = torch.zeros(bucket.numel, dtype=buf.dtype, device=buf.data.device)
                    s_lo, s_hi = bucket.shard_range(g.dp_rank, g.dp_size)
                    for e in by_bucket.get((id(buf), bucket.index), []):
                        at = e.buf_lo - bucket.start
                        scratch[at : at + e.hi - e.lo].copy_(e.main.detach().to(e.model_param.dtype))
                    if g.dp_size > 1:
                        mine = scratch[s_lo - bucket.start : s_hi - bucket.start].clone()
                        _all_gather(scratch, mine, group=g.dp_group)
                    for param in buf.bucket_params(bucket):
                        slot = buf.slot(param)
                        param.data.view(-1).copy_(scratch[slot.start - bucket.start : slot.end - bucket.start])

    # --- accounting ----------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """Bytes this rank holds for optimizer state: fp32 main params + every inner-state tensor."""
        total = sum(e.main.numel() * e.main.element_size() for e in self.entries)
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    # --- checkpoint (layout-independent) ---------------------------------------------------
    def state_dict(self) -> dict:
        """Per-parameter pieces addressable without knowing the DP layout.

        Returns:
            {"kind": "distributed", "param_groups": [hyper-parameters without "params"],
             "params": [ {name: {"local_shape", "flat_range": (lo, hi), "main_param": fp32 [hi-lo],
                                 "state": {key: tensor [hi-lo] or scalar}}} per model chunk ],
             "scaler", "counters": {skipped_iters_total, nan_iters_total, consecutive_skips}}
            ``name`` is the param's name in its chunk; ``flat_range`` indexes the flattened LOCAL
            (TP-sharded) param, which its ShardSpec maps to global coordinates. The pieces of one
            param from all DP ranks tile [0, numel).
        """
        chunks: list = [{} for _ in self.model_chunks]
        for e in self.entries:
            state = self.optimizer.state.get(e.main, {})
            chunks[e.chunk][e.name] = {
                "local_shape": tuple(e.model_param.shape),
                "flat_range": (e.lo, e.hi),
                "main_param": e.main.detach().clone(),
                "state": {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()},
            }
        return {
            "kind": "distributed",
            "param_groups": [{k: v for k, v in grp.items() if k != "params"} for grp in self.optimizer.param_groups],
            "params": chunks,
            **self._scaler_and_counters_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved under any DP size (pieces may come from several ranks).

        Each param entry may be one dict or a list of dicts (pieces from several ranks, or one
        piece with ``flat_range = (0, numel)``); together they must cover this rank's range.
        Per-element state tensors are sliced; scalars (Adam's ``step``) are copied.

        Raises:
            KeyError: a param of this rank is missing from the state dict.
            ValueError: the pieces do not cover this rank's range of a param.
        """
        for e in self.entries:
            entry = state_dict["params"][e.chunk][e.name]
            entries = entry if isinstance(entry, (list, tuple)) else [entry]
            e.main.copy_(_cover(entries, e, lambda x: x["main_param"]))
            state = {}
            for key, value in entries[0]["state"].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == _span(entries[0]):
                    state[key] = _cover(entries, e, lambda x, k=key: x["state"][k])
                else:
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if state:
                self.optimizer.state[e.main] = state
        for grp, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            grp.update({k: v for k, v in saved.items() if k != "params"})
        self._load_scaler_and_counters(state_dict)


def _span(entry: dict) -> int:
    lo, hi = entry["flat_range"]
    return hi - lo


def _cover(entries: list, piece: ShardEntry, get) -> torch.Tensor:
    """Elements [piece.lo, piece.hi) of one param assembled from saved pieces (each with a flat_range)."""
    out = torch.empty(piece.hi - piece.lo, dtype=torch.float32)
    filled = 0
    for e in sorted(entries, key=lambda e: e["flat_range"][0]):
        lo, hi = e["flat_range"]
        a, b = max(lo, piece.lo), min(hi, piece.hi)
        if a < b:
            out[a - piece.lo : b - piece.lo].copy_(get(e).reshape(-1)[a - lo : b - lo])
            filled += b - a
    if filled != piece.hi - piece.lo:
        raise ValueError(
            f"optimizer state of {piece.name!r}: saved pieces cover {filled} of this rank's "
            f"{piece.hi - piece.lo} elements [{piece.lo}, {piece.hi})"
        )
    return out.to(piece.main.device)
