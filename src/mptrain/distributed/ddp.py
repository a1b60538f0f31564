"""Data-parallel wrapper: grads accumulate into contiguous buffers and are SUM-reduced over DP by bucket.

Megatron ``distributed/distributed_data_parallel.py`` + ``param_and_grad_buffer.py`` (design
document §4.1 "main_grad"), without the attributes Megatron bolts onto parameters:

* every grad-requiring param gets a slot in the `GradBuffer` of its grad dtype (fp32 under
  ``grad_reduce_in_fp32``, else the param dtype); ``main_grad(param)`` is a view of it. Expert-parallel
  weights (`ShardSpec.expert_parallel`, Megatron's ``allreduce=False``) have buffers of their own, reduced
  (SUM) over ``groups.edp_group``: the all-to-all's backward already summed their EP peers' tokens into them, so
  the SUM over EDP covers the global batch as the dense SUM over DP does, and the same loss normalisation
  (`finalize_model_grads`) ends both at the per-token mean (Megatron scales both kinds to 1/dp);
* a ``register_post_accumulate_grad_hook`` adds ``param.grad`` into the view and drops
  ``param.grad``, so grads accumulate across micro-batches in the buffer;
* the DP reduction is a SUM (all-reduce, or reduce-scatter under the distributed optimizer); the
  loss normalisation (max_tokens / global tokens) is applied later by `finalize_model_grads`;
* 1-D params (biases, norm weights: small, many) are not added one by one: their hooks queue the
  grad, and a `StagedAdd` per buffer adds them all at the end of the backward pass (an autograd
  final callback), or before a bucket holding them is reduced: one ``torch._foreach_add_`` (bf16/fp16
  grads into fp32 main grads: cast by one ``_foreach_copy_`` first, since a mixed-dtype foreach add
  is one kernel per tensor). The same additions, two launches instead of one per param; larger
  grads are added at once so that none is held longer than before;
* ``no_sync()`` suppresses reduction (all but the last micro-batch); with ``overlap_grad_reduce`` a
  bucket's async collective starts as soon as every param of the bucket has its grad in the synced
  micro-batch. Buckets are launched strictly in index order on every rank (a ready bucket waits
  for its predecessors) so that collectives match across DP ranks even when a param gets no grad;
* with ``gradient_accumulation_fusion`` the layers that implement
  `mptrain.layers.grad_accumulation_fusion.FusesGradAccumulation` (the column/row-parallel linears,
  the output layer) get their weight's ``main_grad`` view and accumulate into it from the weight-grad
  GEMM (no ``param.grad``, no add pass; `mptrain.layers.grad_accumulation`); the hook then fires
  with ``param.grad`` None and only marks the weight ready;
* with the distributed optimizer the updated params come back through `start_param_sync` (the DP
  all-gather of a bucket's updated shards, `mptrain.distributed.param_gather`); under
  ``overlap_param_gather`` it is left pending and forward pre-hooks wait for each bucket where its params
  are first used (Megatron's ``--overlap-param-gather``); `finish_param_sync` lands every pending one.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from mptrain.distributed.accumulate import StagedAdd
from mptrain.distributed.grad_buffer import Bucket, GradBuffer
from mptrain.distributed.param_gather import ParamGather
from mptrain.distributed.wrapper import ChunkWrapper
from mptrain.layers.grad_accumulation_fusion import FusesGradAccumulation
from mptrain.layers.sharding import collect_shard_specs
from mptrain.precision.module import unwrap

# torch >= 2.10 renamed the tensor collectives (the old names warn); accept both.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _BucketState:
    """Per-buffer sync state of one iteration (reset by `finish_grad_sync` / `zero_grad_buffer`)."""

    def __init__(self, buffer: GradBuffer) -> None:
        self.buffer = buffer
        self.ready: list = [set() for _ in buffer.buckets]
        self.works: list = [None] * len(buffer.buckets)
        self.launched: list = [False] * len(buffer.buckets)
        self.next_to_launch = 0

    def reset(self) -> None:
        for s in self.ready:
            s.clear()
        self.works = [None] * len(self.works)
        self.launched = [False] * len(self.launched)
        self.next_to_launch = 0


class DistributedDataParallel(ChunkWrapper):
    """Wrap one model chunk for data parallelism over ``groups.dp_cp_group`` (dp × cp; the DP group at cp = 1).

    Args:
        module: the model chunk (``Float16Module(GPTModel)`` or any nn.Module).
        groups: `ParallelGroups` of the layout.
        specs: {param name (as in module.named_parameters()): ShardSpec}; None = collect from the
            module. Params with ``spec.tied_embedding`` get a bucket of their own.
        grad_reduce_in_fp32: accumulate and reduce grads in fp32 whatever the param dtype.
        overlap_grad_reduce: launch bucket collectives from backward hooks (last micro-batch).
        bucket_size: elements per bucket; None = max(40M, 1M × dp) (Megatron's default).
        use_distributed_optimizer: reduce-scatter instead of all-reduce; buckets padded to a
            multiple of dp so each DP rank owns a contiguous 1/dp of every bucket.
        gradient_accumulation_fusion: call ``fuse_grad_accumulation(main_grad)`` on every submodule
            that implements `mptrain.layers.grad_accumulation_fusion.FusesGradAccumulation` (the
            column/row-parallel linears, `GPTModel` for its output layer, a user's layer), so that
            its backward accumulates into the weights' ``main_grad`` views directly (Megatron's
            ``gradient_accumulation_fusion``). A tied weight's other use (the embedding lookup)
            still arrives as ``param.grad`` through the hook, which autograd calls once, after both.
        overlap_param_gather: the updated params' all-gathers (`start_param_sync`) are waited for where the
            params are first used in the next forward (pre-hooks on the chunk's
            `mptrain.layers.param_use.ParamUseRegions`), not in the optimizer step. Needs
            ``use_distributed_optimizer``.
    Raises:
        ValueError: bucket_size < 1; overlap_param_gather without use_distributed_optimizer.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        groups,
        *,
        specs: Optional[dict] = None,
        grad_reduce_in_fp32: bool,
        overlap_grad_reduce: bool,
        bucket_size: Optional[int],
        use_distributed_optimizer: bool,
        gradient_accumulation_fusion: bool = False,
        overlap_param_gather: bool = False,
    ) -> None:
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError("DistributedDataParallel: overlap_param_gather=True gathers the distributed optimizer's "
                             "updated shards; it needs use_distributed_optimizer=True")
        super().__init__()
        self.module = module
        self.groups = groups
        self.specs = dict(specs) if specs is not None else collect_shard_specs(module)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self._sync_enabled = True
        by_kind: dict = {}  # (grad dtype, expert-parallel) -> [(name, param)]
        for name, param in module.named_parameters():
            if param.requires_grad:
                grad_dtype = torch.float32 if grad_reduce_in_fp32 else param.dtype
                expert = name in self.specs and self.specs[name].expert_parallel
                by_kind.setdefault((grad_dtype, expert), []).append((name, param))
        tied = frozenset(n for n, s in self.specs.items() if s.tied_embedding)
        device = next(module.parameters()).device if any(True for _ in module.parameters()) else torch.device("cpu")
        self._grad_buffers = tuple(
            GradBuffer(
                named,
                dtype=dtype,
                bucket_size=bucket_size,
                dp_size=groups.edp_size if expert else groups.dp_cp_size,
                pad_for_dp=use_distributed_optimizer,
                own_bucket=tied,
                device=device,
                expert=expert,
            )
            for (dtype, expert), named in by_kind.items()
        )
        self._states = tuple(_BucketState(b) for b in self._grad_buffers)
        self._deferred: dict = {  # state -> the 1-D grads queued for one multi-tensor add
            id(s): StagedAdd({p: p.numel() for p in s.buffer.params() if p.dim() == 1},
                             dtype=s.buffer.data.dtype, device=s.buffer.data.device)
            for s in self._states}
        self._flush_queued = False
        self._hook_handles = []
        for state in self._states:
            for param in state.buffer.params():
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._make_hook(state, param)))
        if gradient_accumulation_fusion:
            for layer in module.modules():
                if isinstance(layer, FusesGradAccumulation):
                    layer.fuse_grad_accumulation(self._fused_main_grad)
        self.overlap_param_gather = overlap_param_gather
        self._param_gather = ParamGather(self._grad_buffers, groups, overlap=overlap_param_gather)
        if overlap_param_gather:
            self._hook_handles += self._param_gather.install_hooks(unwrap(module))

    def release(self) -> None:
        """Remove the params' hooks (the run is over; the wrapper is not used again).

        A post-accumulate-grad hook is held by the param's C++ autograd state, so the cycle param -> hook ->
        this wrapper -> param is invisible to Python's garbage collector: without this, a finished run's model,
        grad buffers and process groups (gloo's threads) stay alive in the process that ran it."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # --- buffers ---------------------------------------------------------------------------
    @property
    def grad_buffers(self) -> tuple:
        """The `GradBuffer`s (one per grad dtype); ``buffers()`` stays ``nn.Module``'s (registered module buffers)."""
        return self._grad_buffers

    def _buffer_of(self, param: torch.Tensor) -> GradBuffer:
        for buf in self._grad_buffers:
            if param in buf:
                return buf
        raise KeyError("parameter is not managed by this DistributedDataParallel (requires_grad=False?)")

    def _fused_main_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """`FusesGradAccumulation`'s ``main_grad``: None for a param without grad (no slot here)."""
        return self.main_grad(param) if param.requires_grad else None

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The accumulated grad of ``param``: a view of the contiguous buffer, shaped like ``param``.

        Raises:
            KeyError: the param does not belong to this wrapper.
        """
        return self._buffer_of(param).main_grad(param)

    def named_main_grads(self) -> list:
        """[(name, param, main_grad view)] over all buffers, in buffer order."""
        out = []
        for buf in self._grad_buffers:
            for p in buf.params():
                out.append((buf.slot(p).name, p, buf.main_grad(p)))
        return out

    # --- module passthrough ----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._param_gather.finish_unhooked()  # params no pre-hook waits for (overlap_param_gather; else nothing pending)
        return self.module(*args, **kwargs)

    # --- param sync (the distributed optimizer's all-gather) ------------------------------------
    def start_param_sync(self, buffer: GradBuffer, bucket: Bucket, scratch: torch.Tensor) -> None:
        """All-gather ``scratch`` (``bucket.numel`` elements in ``buffer``'s dtype, this DP rank's shard of the
        bucket holding its updated values) over DP and copy it into the bucket's params: at once, or under
        ``overlap_param_gather`` where they are first used (`mptrain.distributed.param_gather.ParamGather`).
        Collective over DP, called for the same buckets in the same order on every DP rank."""
        self._param_gather.start(self._grad_buffers.index(buffer), bucket, scratch)

    def finish_param_sync(self) -> None:
        """Land every pending param all-gather in the params (before anything reads them outside a forward:
        evaluation, a checkpoint save, the FP8 weight casts, the end of training); nothing when none is pending."""
        self._param_gather.finish_all()

    def pending_param_syncs(self) -> list:
        """[(buffer index, bucket index)] whose all-gather is launched and not yet copied (tests, debugging)."""
        return self._param_gather.pending

    # --- accumulation and sync ---------------------------------------------------------------
    def _make_hook(self, state: _BucketState, param: torch.Tensor):
        view = state.buffer.main_grad(param)
        staged = self._deferred[id(state)]
        deferred = param.dim() == 1  # a bias or norm weight: added with the others at the end of backward

        def hook(param: torch.Tensor) -> None:
            # Grads accumulate in the buffer across micro-batches; param.grad is dropped so that
            # autograd allocates a fresh (not accumulated-into) grad next backward. None: the
            # linear layer already accumulated it (gradient accumulation fusion).
            grad = param.grad
            if grad is not None:
                param.grad = None
                if deferred:
                    staged.queue(param, view, grad)
                    if not self._flush_queued:
                        self._flush_queued = True
                        torch.autograd.Variable._execution_engine.queue_callback(self._flush_deferred)
                else:
                    view.add_(grad)
            self._mark_ready(state, param)

        return hook

    def _flush_state(self, state: _BucketState) -> None:
        """Add the queued grads of ``state``'s buffer into their main grads (`StagedAdd.flush`)."""
        self._deferred[id(state)].flush()

    def _flush_deferred(self) -> None:
        """The end-of-backward callback: every queued grad into the buffers."""
        self._flush_queued = False
        for state in self._states:
            self._flush_state(state)

    def _mark_ready(self, state: _BucketState, param: torch.Tensor) -> None:
        """Count ``param``'s grad of this micro-batch as in; launch the buckets that became ready."""
        if not (self.overlap_grad_reduce and self._sync_enabled):
            return
        slot = state.buffer.slot(param)
        ready = state.ready[slot.bucket]
        ready.add(slot.name)
        if len(ready) == len(state.buffer.buckets[slot.bucket].param_names):
            self._launch_ready(state)

    def _launch_ready(self, state: _BucketState) -> None:
        """Launch, in index order, every bucket whose params are all ready and whose predecessors launched."""
        buckets = state.buffer.buckets
        while state.next_to_launch < len(buckets):
            b = buckets[state.next_to_launch]
            if len(state.ready[b.index]) < len(b.param_names):
                return
            self._launch(state, b)

    def _launch(self, state: _BucketState, bucket: Bucket) -> None:
        assert bucket.index == state.next_to_launch and not state.launched[bucket.index]
        self._flush_state(state)  # queued bias / norm grads must be in the buffer before it is reduced
        data = state.buffer.bucket_data(bucket)
        group, rank, size = state.buffer.reduction(self.groups)  # DP, or expert-DP for expert weights
        if size == 1:
            work = None
        elif self.use_distributed_optimizer:
            lo, hi = bucket.shard_range(rank, size)
            shard = state.buffer.data[lo:hi]
            work = _reduce_scatter(shard, data, op=dist.ReduceOp.SUM, group=group, async_op=True)
        else:
            work = dist.all_reduce(data, op=dist.ReduceOp.SUM, group=group, async_op=True)
        state.works[bucket.index] = work
        state.launched[bucket.index] = True
        state.next_to_launch += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Reduce nothing inside (grads only accumulate); use for all but the last micro-batch."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launch every bucket not launched yet (async), in index order."""
        self._flush_deferred()
        for state in self._states:
            while state.next_to_launch < len(state.buffer.buckets):
                self._launch(state, state.buffer.buckets[state.next_to_launch])

    def finish_grad_sync(self) -> None:
        """Complete the DP reduction of every bucket (launching what is left), then reset the sync state.

        After it, under all-reduce every ``main_grad`` holds the DP SUM; under the distributed
        optimizer only this rank's shard range of each bucket does (the rest is stale).
        """
        self.start_grad_sync()
        for state in self._states:
            for work in state.works:
                if work is not None:
                    work.wait()
            state.reset()

    def launched_buckets(self) -> list:
        """[(buffer index, bucket index)] whose collective has been launched this iteration (tests, debugging)."""
        return [(i, b) for i, s in enumerate(self._states) for b, done in enumerate(s.launched) if done]

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer (padding included) and drop any stray ``param.grad``; reset sync state."""
        self._flush_queued = False  # a backward that raised never ran its callback
        for state in self._states:
            self._deferred[id(state)].clear()
            state.buffer.data.zero_()
            state.reset()
            for p in state.buffer.params():
                p.grad = None

    def scale_gradients(self, factor) -> None:
        """Multiply every main grad by ``factor`` (a Python number or a 0-d tensor; no host sync)."""
        for buf in self._grad_buffers:
            buf.data.mul_(factor)
