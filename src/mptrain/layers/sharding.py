"""Sharding metadata of parameters: one typed record per parameter, owned by the layers.

Instead of attributes bolted onto tensors (Megatron's ``tensor_model_parallel``, ``shared``,
``sequence_parallel``), every module that holds parameters describes them with `ShardSpec`s
(`ShardedModule.local_shard_specs`), and `collect_shard_specs` walks a model and returns one
spec per parameter name. Everyone who needs to know how a parameter relates to the full,
layout-independent model reads it from here:

- grad-norm clipping (count TP-replicated params once, skip the tied embedding's second copy),
- finalize_model_grads (which grads to all-reduce over TP under sequence parallelism, which over
  the embedding group),
- checkpoints (global unpadded shape and offset of each shard),
- parameter counts and layout.json (padding excluded),
- weight decay groups and the decoupled-LR groups of the embedding and output layer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one local parameter maps onto the full (unpadded, layout-independent) tensor.

    Attributes:
        global_shape: shape of the full unpadded tensor, e.g. [vocab_size, hidden] for the word
            embedding, [3 * h, h] for a fused QKV weight.
        partition_dim: the dim split over TP ranks; None when the param is replicated over TP
            (LayerNorm, row-parallel bias, position embedding).
        offset: start of this shard along ``partition_dim`` in global (unpadded) coordinates.
        valid: how many entries along ``partition_dim`` of the local tensor are real; the rest
            (at the end) are vocab padding. Equals the local size where nothing is padded.
        interleave: for fused projections whose columns are laid out per head/group (QKV), the
            number of equal parts the global tensor is split into before sharding (1 = plain
            contiguous split). A local shard then holds part-local slices: its ``partition_dim`` is
            ``interleave`` equal pieces, piece j being rows ``[offset, offset + n)`` of global part j
            (``offset`` is then measured inside a part). Used for SwiGLU's fused [gate; up] fc1.
            See `shard_slices`.
        sequence_parallel_grad: the grad must be all-reduced over TP (norms / row-parallel biases
            under sequence parallelism).
        tied_embedding: this param is the (tied) word embedding or its output-layer copy.
        is_shared_copy: the last stage's copy of a tied embedding (pp > 1): kept equal to the
            first stage's copy; excluded from grad norm and parameter counts.
        no_weight_decay: biases and norm params.
        embedding_or_output: the input word embedding (first stage) or the output layer's weight (last stage,
            the tied copy included): Megatron's ``is_embedding_or_output_parameter``, the params that
            ``optim.decoupled_lr`` drives (their own param groups, `mptrain.optim.param_groups`).
        expert_parallel: a routed-expert weight split over the expert-parallel ranks (ep > 1; Megatron's
            ``allreduce=False``): its grads are reduced over the expert-data-parallel group in buffers of their
            own, and the grad norm sums it over the EP ranks (each holds other experts).
        expert_offset: the global index of this rank's first local expert: the local tensor's dim 0 starts there in
            the global expert axis (dim 0 of ``global_shape``; checkpoints address it, Megatron's
            ``ep_rank * num_local_experts`` offset). 0 for every other param.
    """

    global_shape: tuple
    partition_dim: Optional[int] = None
    offset: int = 0
    valid: Optional[int] = None
    interleave: int = 1
    sequence_parallel_grad: bool = False
    tied_embedding: bool = False
    is_shared_copy: bool = False
    no_weight_decay: bool = False
    embedding_or_output: bool = False
    expert_parallel: bool = False
    expert_offset: int = 0

    @property
    def tp_replicated(self) -> bool:
        return self.partition_dim is None

    def counts_on(self, tp_rank: int) -> bool:
        """Whether this rank's copy counts toward global sums (grad norm, param counts)."""
        if self.is_shared_copy:
            return False
        return self.partition_dim is not None or tp_rank == 0


@runtime_checkable
class ShardedModule(Protocol):
    def local_shard_specs(self) -> dict:
        """{local parameter name (as in named_parameters(recurse=False)): ShardSpec}."""


def replicated_spec(param: torch.Tensor, *, no_weight_decay: bool = False, sequence_parallel_grad: bool = False) -> ShardSpec:
    """Spec of a parameter held whole on every TP rank."""
    return ShardSpec(
        global_shape=tuple(param.shape),
        no_weight_decay=no_weight_decay,
        sequence_parallel_grad=sequence_parallel_grad,
        valid=None,
    )


def collect_shard_specs(model: torch.nn.Module) -> dict:
    """{full parameter name: ShardSpec} for every parameter of ``model``.

    Modules implementing `ShardedModule` describe their own direct parameters; any other
    parameter is replicated over TP (1-D ones excluded from weight decay).
    """
    specs = {}
    for mod_name, module in model.named_modules():
        own = module.local_shard_specs() if isinstance(module, ShardedModule) else {}
        for p_name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            specs[full] = own.get(p_name) or replicated_spec(param, no_weight_decay=param.dim() == 1)
    return specs


def shard_slices(spec: ShardSpec, local_len: int) -> list:
    """Where the real entries of a local shard live, along ``spec.partition_dim``.

    Args:
        spec: the parameter's spec (``partition_dim`` not None).
        local_len: local size along ``partition_dim`` (padded size for the vocabulary).
    Returns:
        [(local_start, global_start, length), ...]: one triple per interleaved piece (one for a
        plain split). Padded rows (``valid`` < local_len) are not covered.
    """
    k = spec.interleave
    if k == 1:
        valid = local_len if spec.valid is None else spec.valid
        return [(0, spec.offset, valid)] if valid > 0 else []
    n = local_len // k
    part = spec.global_shape[spec.partition_dim] // k
    return [(j * n, j * part + spec.offset, n) for j in range(k)]


def take_shard(full: torch.Tensor, spec: ShardSpec, local_len: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of a full (unpadded) tensor; padded rows are zeros.

    Args:
        full: tensor of ``spec.global_shape``.
        local_len: local size along ``partition_dim`` (default: the valid size, i.e. no padding).
    Returns:
        the local tensor (a new tensor, contiguous).
    """
    if spec.partition_dim is None:
        return full.clone()
    dim = spec.partition_dim
    if local_len is None:
        if spec.valid is None or spec.interleave != 1:
            raise ValueError("take_shard: local_len is required for specs without `valid` or with interleave > 1")
        local_len = spec.valid
    shape = list(full.shape)
    shape[dim] = local_len
    out = torch.zeros(shape, dtype=full.dtype, device=full.device)
    for local_start, global_start, n in shard_slices(spec, local_len):
        out.narrow(dim, local_start, n).copy_(full.narrow(dim, global_start, n))
    return out


def place_shard(full: torch.Tensor, local: torch.Tensor, spec: ShardSpec) -> None:
    """Write a local shard's real entries into ``full`` (inverse of `take_shard`; padding dropped)."""
    if spec.partition_dim is None:
        full.copy_(local)
        return
    dim = spec.partition_dim
    for local_start, global_start, n in shard_slices(spec, local.shape[dim]):
        full.narrow(dim, global_start, n).copy_(local.narrow(dim, local_start, n))


def gather_full_tensor(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The full unpadded tensor of ``spec.global_shape`` from the TP shards (collective over ``group``).

    Every rank passes its local shard and spec; ranks exchange (offset, valid) and the shards with
    all-gathers (works on gloo and NCCL). Replicated params are returned as a copy.
    """
    import torch.distributed as dist

    if spec.partition_dim is None or group is None or dist.get_world_size(group) == 1:
        full = torch.empty(spec.global_shape, dtype=local.dtype, device=local.device)
        place_shard(full, local, spec)
        return full
    p = dist.get_world_size(group)
    meta = torch.tensor([spec.offset, -1 if spec.valid is None else spec.valid], dtype=torch.int64, device=local.device)
    metas = [torch.empty_like(meta) for _ in range(p)]
    dist.all_gather(metas, meta, group=group)
    shards = [torch.empty_like(local.contiguous()) for _ in range(p)]
    dist.all_gather(shards, local.contiguous(), group=group)
    full = torch.zeros(spec.global_shape, dtype=local.dtype, device=local.device)
    for m, shard in zip(metas, shards):
        offset, valid = int(m[0]), int(m[1])
        other = dataclasses.replace(spec, offset=offset, valid=None if valid < 0 else valid)
        place_shard(full, shard, other)
    return full


def iter_params_with_specs(model: torch.nn.Module) -> Iterator[tuple]:
    """(name, param, spec) for every parameter, in named_parameters() order."""
    specs = collect_shard_specs(model)
    for name, param in model.named_parameters():
        yield name, param, specs[name]
