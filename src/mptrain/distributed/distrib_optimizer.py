"""ZeRO-1 distributed optimizer: fp32 main params and optimizer state only for this DP rank's shard.

Megatron ``optimizer/distrib_optimizer.py`` (megatron-core.md §1 "Distributed optimizer"), on top of
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
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mptrain.optim.builders import param_groups
from mptrain.precision.clip_grads import all_reduce_over, clip_grads_by_total_norm, count_zeros_fp32, get_grad_norm_fp32

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Outcome of one optimizer step (same fields as `mptrain.precision.optimizer.StepResult`).

    grad_norm: global L2 norm of the unscaled, unclipped grads (None when the step was skipped);
    num_zeros: exactly-zero grad elements, counted once over the world; found_inf: any inf/nan.
    """

    update_successful: bool
    grad_norm: Optional[float]
    num_zeros: Optional[float]
    found_inf: bool


@dataclasses.dataclass
class _Piece:
    """This rank's contiguous piece of one model param: param elements [lo, hi) = buffer [buf_lo, buf_lo + hi - lo)."""

    chunk: int
    name: str
    param: torch.nn.Parameter
    spec: object
    buffer: object
    bucket: object
    lo: int
    hi: int
    buf_lo: int
    main: torch.nn.Parameter


class DistributedOptimizer:
    """ZeRO-1 over the DP group; the interface of `MixedPrecisionOptimizer` / `FP32Optimizer`.

    Args:
        build_optimizer: ``param_groups -> torch.optim.Optimizer`` (`mptrain.optim.builders.build_optimizer_factory`).
        model_chunks: this rank's `DistributedDataParallel` chunks built with ``use_distributed_optimizer=True``.
        groups: `ParallelGroups`.
        scaler: a `LossScaler` (fp16/bf16) or None (no loss scaling).
        clip_grad: max global grad norm; <= 0 disables clipping.
        max_consecutive_skips: raise after more skipped steps in a row than this; None = never.
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
        max_consecutive_skips: Optional[int] = None,
    ) -> None:
        for i, chunk in enumerate(model_chunks):
            if not chunk.use_distributed_optimizer:
                raise ValueError(
                    f"DistributedOptimizer: model chunk {i} was wrapped with use_distributed_optimizer=False; "
                    "build DistributedDataParallel with parallel.use_distributed_optimizer=true"
                )
        self.model_chunks = list(model_chunks)
        self.groups = groups
        self.scaler = scaler
        self.clip_grad = float(clip_grad or 0.0)
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_iters_total = 0
        self.nan_iters_total = 0
        self.consecutive_skips = 0
        self.pieces = self._make_pieces()
        self.optimizer = build_optimizer(param_groups([p.main for p in self.pieces], [p.spec for p in self.pieces]))

    # --- layout --------------------------------------------------------------------------
    def _make_pieces(self) -> list:
        g = self.groups
        pieces = []
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
                        pieces.append(_Piece(ci, slot.name, param, chunk.specs[slot.name], buf, bucket, lo, hi, b_lo, main))
        return pieces

    def _mp_dp_groups(self) -> tuple:
        return (self.groups.dp_group, self.groups.mp_group)

    # --- the step ------------------------------------------------------------------------
    def _prepare_main_grads(self) -> list:
        grads = []
        for piece in self.pieces:
            view = piece.buffer.data[piece.buf_lo : piece.buf_lo + piece.hi - piece.lo]
            # fp32 buffer: use the view itself (unscale/clip act in place, as Megatron); else an fp32 copy.
            piece.main.grad = view if view.dtype == torch.float32 else view.float()
            grads.append(piece.main.grad)
        return grads

    def _unscale_and_check(self, grads: list) -> bool:
        found = torch.zeros(1, dtype=torch.float32, device=self.groups.device)
        inv = self.scaler.inv_scale.to(found.device) if self.scaler is not None else torch.ones(1, device=found.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        all_reduce_over(found, self._mp_dp_groups(), dist.ReduceOp.MAX)
        return bool(found.item() > 0)  # host sync (once per step)

    def step(self) -> StepResult:
        """Unscale, check, clip and step the owned shard, then all-gather the updated params.

        Raises:
            RuntimeError: more than ``max_consecutive_skips`` skipped steps in a row.
        """
        grads = self._prepare_main_grads()
        found_inf = self._unscale_and_check(grads)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped_iters_total += 1
            self.consecutive_skips += 1
            if self.scaler is None or not getattr(self.scaler, "dynamic", False):
                self.nan_iters_total += 1  # no overflow is expected here: a real inf/nan
            if self.max_consecutive_skips is not None and self.consecutive_skips > self.max_consecutive_skips:
                raise RuntimeError(
                    f"{self.consecutive_skips} optimizer steps skipped in a row (inf/nan grads; loss scale "
                    f"{float(self.get_loss_scale().reshape(-1)[0]):g}) exceeds loss_scaler.max_consecutive_skips="
                    f"{self.max_consecutive_skips}; lower optim.lr, check the data, or raise the limit"
                )
            return StepResult(False, None, None, True)
        self.consecutive_skips = 0
        counted = [p.main.grad for p in self.pieces if p.spec.counts_on(self.groups.tp_rank)]
        grad_norm = get_grad_norm_fp32(counted, self._mp_dp_groups(), device=self.groups.device)
        num_zeros = count_zeros_fp32(counted, self._mp_dp_groups(), device=self.groups.device)
        if self.clip_grad > 0:
            clip_grads_by_total_norm(grads, self.clip_grad, grad_norm)
        self.optimizer.step()
        self._gather_params()
        return StepResult(True, float(grad_norm), float(num_zeros), False)

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Write the updated pieces into per-bucket scratch, all-gather over DP, copy into the model params."""
        by_bucket: dict = {}
        for piece in self.pieces:
            by_bucket.setdefault((id(piece.buffer), piece.bucket.index), []).append(piece)
        g = self.groups
        for chunk in self.model_chunks:
            for buf in chunk.buffers:
                for bucket in buf.buckets:
                    # Scratch in the buffer's dtype: it is the param dtype, or fp32 (which holds any
                    # fp16/bf16 value exactly), so every param gets its own dtype's rounding.
                    scratch = torch.zeros(bucket.numel, dtype=buf.dtype, device=buf.data.device)
                    s_lo, s_hi = bucket.shard_range(g.dp_rank, g.dp_size)
                    for piece in by_bucket.get((id(buf), bucket.index), []):
                        at = piece.buf_lo - bucket.start
                        scratch[at : at + piece.hi - piece.lo].copy_(piece.main.detach().to(piece.param.dtype))
                    if g.dp_size > 1:
                        mine = scratch[s_lo - bucket.start : s_hi - bucket.start].clone()
                        _all_gather(scratch, mine, group=g.dp_group)
                    for param in buf.bucket_params(bucket):
                        slot = buf.slot(param)
                        param.data.view(-1).copy_(scratch[slot.start - bucket.start : slot.end - bucket.start])

    def zero_grad(self) -> None:
        """Drop the main grads and zero every chunk's grad buffer (start of an iteration)."""
        for piece in self.pieces:
            piece.main.grad = None
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale S (float32 [1] tensor; 1.0 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else torch.ones(1)

    # --- accounting ----------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """Bytes held by this rank for optimizer state: fp32 main params + every inner-state tensor."""
        total = sum(p.main.numel() * p.main.element_size() for p in self.pieces)
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
             "scaler", "skipped_iters_total", "nan_iters_total", "consecutive_skips"}
            ``flat_range`` indexes the flattened LOCAL (TP-sharded) param; its ShardSpec maps that
            to global coordinates. Pieces of one param from all DP ranks tile [0, numel).
        """
        chunks: list = [{} for _ in self.model_chunks]
        for piece in self.pieces:
            state = self.optimizer.state.get(piece.main, {})
            chunks[piece.chunk][piece.name] = {
                "local_shape": tuple(piece.param.shape),
                "flat_range": (piece.lo, piece.hi),
                "main_param": piece.main.detach().clone(),
                "state": {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()},
            }
        return {
            "kind": "distributed",
            "param_groups": [{k: v for k, v in grp.items() if k != "params"} for grp in self.optimizer.param_groups],
            "params": chunks,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_iters_total": self.skipped_iters_total,
            "nan_iters_total": self.nan_iters_total,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved under any DP size (or ZeRO off, as full flat ranges).

        Each param entry may be one dict or a list of dicts (pieces from several ranks); the
        pieces of a param must cover this rank's range. Per-element state tensors are sliced;
        scalars (Adam's ``step``) are copied.

        Raises:
            KeyError: a param of this rank is missing from the state dict.
            ValueError: the pieces do not cover this rank's range of a param.
        """
        for piece in self.pieces:
            entry = state_dict["params"][piece.chunk][piece.name]
            entries = entry if isinstance(entry, (list, tuple)) else [entry]
            main = _cover(entries, piece, lambda e: e["main_param"])
            piece.main.data.copy_(main)
            state = {}
            for key, value in entries[0]["state"].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == _span(entries[0]):
                    state[key] = _cover(entries, piece, lambda e, k=key: e["state"][k]).clone()
                else:
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if state:
                self.optimizer.state[piece.main] = state
        for grp, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            grp.update({k: v for k, v in saved.items() if k != "params"})
        if self.scaler is not None and state_dict.get("scaler") is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_iters_total = int(state_dict.get("skipped_iters_total", 0))
        self.nan_iters_total = int(state_dict.get("nan_iters_total", 0))
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))


def _span(entry: dict) -> int:
    lo, hi = entry["flat_range"]
    return hi - lo


def _cover(entries: list, piece: _Piece, get) -> torch.Tensor:
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
