"""ZeRO-2 / ZeRO-3 data parallelism on torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

`FullyShardedDataParallel` wraps one model chunk as `DistributedDataParallel` does and offers the same interface
to the schedules, `finalize_model_grads`, the trainer and the checkpoint (``module``, ``specs``, ``no_sync``,
``finish_grad_sync``, ``named_main_grads``, ``scale_gradients``, ``zero_grad_buffer``, ``finish_param_sync``).

Layout (torchtitan ``torchtitan/distributed/fsdp.py``, Megatron's torch-FSDP2 wrapper):

* the mesh is this rank's DP group (the dp ranks of its tp / pp coordinate; with context parallelism the dp × cp
  ranks, cp fastest: torchtitan's ``dp_shard_cp`` dimension, since the cp ranks' grads of one weight sum as the dp
  ranks' do, while the CP ring keeps its own cp group): one dimension, or under HSDP
  (``parallel.data_parallel_shard_size`` = S < dp × cp) two, ``(dp_replicate, dp_shard)`` = those ranks viewed as
  [dp·cp / S, S] (torchtitan's dim names and order; `mptrain.groups`: shard over S consecutive DP ranks, Megatron's
  distributed-optimizer instance), so each param is ``(Replicate(), Shard(0))``: grads are reduce-scattered within
  the shard group and the shards all-reduced across the replicas. FSDP shards the
  TP-local tensors: a column-parallel weight ``[out/tp, in]`` is cut again on dim 0 into ``torch.chunk`` pieces of
  ceil(out/tp / dp) rows; each DP rank's shard is one rectangle of the full tensor (TP offset + FSDP rows), which
  checkpoints address with `mptrain.checkpoint.reshard` (a flat range of the TP-local tensor);
* one FSDP unit (one all-gather, one reduce-scatter) per region where the chunk first uses its params
  (`mptrain.layers.param_use.ParamUseRegions`: the embedding, each transformer layer, the final norm, the output
  layer), then the chunk itself as the root for the rest. The region holding the weight the output layer
  multiplies by (the tied embedding on a one-stage chunk) stays with the root, which keeps its params gathered
  from the forward to the backward (the output layer needs them after the embedding's forward);
* ``MixedPrecisionPolicy(param_dtype=bf16 / fp16, reduce_dtype=fp32)``: the sharded params are the fp32 master
  weights the optimizer steps in place (`mptrain.distributed.fsdp_optimizer`), the all-gather casts them to the
  compute dtype, grads are reduce-scattered in fp32. Before sharding, the fp32 init is rounded through the compute
  dtype once (`mptrain.precision.module.round_params_to`): DDP's fp32 main params are copies of its bf16 / fp16
  params (`Float16Module`'s cast), so every strategy starts from the same master weights (a checkpoint loaded later
  overwrites them with its own). Their steps then differ only where the grads do: the fp32 summation order (each
  micro-batch's reduce-scatter, the grad norm's partial sums) and DDP's gradient accumulation fusion, which adds a
  tied output weight's grad into its fp32 buffer apart from the embedding's, where autograd (FSDP) sums the two in
  the compute dtype first; 16-bit weights and FP8 casts magnify such last-bit differences over the steps;
* the reduction is a SUM (``set_gradient_divide_factor(1)``, SUM collectives for every backend): the loss
  normalisation is `finalize_model_grads`' (ARCHITECTURE.md "Loss normalisation"), as for DDP;
* ``reshard_after_forward``: True for ZeRO-3 (``optim_grads_params``), False for ZeRO-2, and False under pipeline
  parallelism whatever the strategy (torchtitan: 1F1B interleaves forwards and backwards of micro-batches, so
  re-gathering per micro-batch costs two all-gathers each and cannot follow FSDP's prefetch order);
* ``model.compile_layers``: each layer is its own graph, never the chunk as one (`GPTModel.compile_per_layer`,
  torchtitan's per-block compile under FSDP2): FSDP's pre-forward hooks run eagerly outside a graph, so one chunk
  graph would make the whole chunk one unit, every param gathered at once for the whole forward and backward;
* ``precision=fp8``: the block linears keep no per-iteration FP8 weight cast (outside its layer's forward and
  backward a weight is a shard); each FP8 GEMM casts the bf16 weight gathered here (`mptrain.layers.fp8.apply_fp8`,
  ``cache_weight_casts``), as torchao's ``Float8Linear`` under FSDP2 without its FP8 all-gather;
* MoE experts under expert parallelism (ep > 1) are units of their own on the expert-data-parallel group's mesh
  (their replicas), inside their layer's unit; at ep = 1 they shard with their layer over DP;
* ``optim.optimizer_cpu_offload``: ``CPUOffloadPolicy`` (pinned on CUDA): the fp32 shards, their grads and so the
  optimizer's state and step live in host memory; each unit's all-gather copies its shards to the device first;
* gradient accumulation (`no_sync` around every backward but a chunk's last): without PP each micro-batch's
  backward reduce-scatters each unit's grads as it finishes and the fp32 shards accumulate (torchtitan's default:
  no full-size grad is ever held, the reduce-scatter hides behind the backward); under PP the stage's params stay
  gathered and its grads accumulate unsharded in fp32, reduce-scattered once after the last micro-batch (torch's
  pipelining stages do the same: 1F1B's interleaved forwards and backwards would re-gather every micro-batch).
  With CPU offload the grads also accumulate unsharded in fp32 on the device (4 bytes a param there while a step
  has more than one micro-batch; the params are still resharded after each backward): FSDP2 would otherwise copy
  each micro-batch's grad shards to host memory and add them there, a blocking pass over every shard per
  micro-batch; this way they reduce and offload once per step.

Gradient accumulation fusion (``parallel.gradient_accumulation_fusion``) does not apply: FSDP owns the grads.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from mptrain.distributed.strategy import FULLY_SHARDED, OPTIM_GRADS_PARAMS
from mptrain.distributed.wrapper import ChunkWrapper
from mptrain.layers.param_use import ParamUseRegions
from mptrain.layers.sharding import collect_shard_specs
from mptrain.precision.module import round_params_to


COMPILE_BLOCKER = "ZeRO-2 / ZeRO-3: FSDP2 gathers each layer's params around that layer's graph"


def dp_mesh(groups, device_type: Optional[str] = None) -> DeviceMesh:
    """The mesh FSDP shards over (no new communicator): this rank's dp × cp group (``groups.dp_cp_group``: the DP
    group at cp = 1), or under HSDP the 2-D ``(dp_replicate, dp_shard)`` mesh of ``groups.dp_replicate_group`` ×
    ``groups.dp_shard_group``: the dp × cp ranks viewed as [dp·cp / S, S], whose rows are the shard groups and
    columns the replica groups."""
    # a build on the meta device (`mptrain.check`'s dry run) shards over the host backend's mesh
    device_type = device_type or ("cpu" if groups.device.type == "meta" else groups.device.type)
    if groups.dp_replicate_size == 1:
        return DeviceMesh.from_group(groups.dp_cp_group, device_type)
    ranks = torch.tensor(groups.ranks["dp_cp"]).view(groups.dp_replicate_size, groups.dp_shard_size)
    return DeviceMesh.from_group([groups.dp_replicate_group, groups.dp_shard_group], device_type, mesh=ranks,
                                 mesh_dim_names=("dp_replicate", "dp_shard"))


def _units(chunk: torch.nn.Module) -> list:
    """The submodules sharded as units of their own, in forward order (module docstring); [] for a chunk that
    names no regions (all its params then belong to the root unit)."""
    if not isinstance(chunk, ParamUseRegions):
        return []
    regions = [r for r in chunk.param_use_regions() if r is not chunk and any(True for _ in r.parameters())]
    output = chunk.output_weight() if hasattr(chunk, "output_weight") else None
    units = []
    for i, region in enumerate(regions):
        # a weight used again outside its region (the tied embedding on a one-stage chunk): the root holds it
        if output is not None and i < len(regions) - 1 and any(p is output for p in region.parameters()):
            continue
        units.append(region)
    return units


def _expert_modules(chunk: torch.nn.Module, specs: dict) -> list:
    """The largest submodules of ``chunk`` whose params are all expert-parallel (`ShardSpec.expert_parallel`: the
    routed experts of an MoE layer under ep > 1), in forward order."""
    names = {n for n, spec in specs.items() if spec.expert_parallel}
    found: list = []
    for prefix, m in chunk.named_modules():
        params = [f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters()]
        if not params or not all(p in names for p in params):
            continue
        if not any(prefix.startswith(f"{q}.") for q, _ in found):
            found.append((prefix, m))
    return [m for _, m in found]


class FullyShardedDataParallel(ChunkWrapper):
    """One model chunk sharded over ``groups.dp_cp_group`` (HSDP: ``groups.dp_shard_group``) with FSDP2 (module
    docstring).

    Args:
        module: the model chunk (e.g. `GPTModel`), fp32 params, not wrapped; sharded in place (with a 16-bit
            ``compute_dtype``, its params rounded through it first: module docstring).
        groups: `ParallelGroups`.
        strategy: ``optim_grads`` (ZeRO-2) or ``optim_grads_params`` (ZeRO-3).
        compute_dtype: the dtype of the gathered params and the activations (fp32, bf16 or fp16).
        specs: {param name: ShardSpec}; None collects them from the module (before sharding).
        is_last_stage: the chunk returns the loss / logits: floating outputs come back as fp32 (as `Float16Module`).
        cpu_offload: keep the fp32 shards (and their grads) in host memory (``optim.optimizer_cpu_offload``).
    Raises:
        ValueError: ``strategy`` is not one of `FULLY_SHARDED`.
    """

    use_distributed_optimizer = False
    overlap_param_gather = False
    grad_buffers: tuple = ()

    def __init__(self, module: torch.nn.Module, groups, *, strategy: str, compute_dtype: torch.dtype,
                 specs: Optional[dict] = None, is_last_stage: bool = False, cpu_offload: bool = False) -> None:
        if strategy not in FULLY_SHARDED:
            raise ValueError(f"FullyShardedDataParallel: strategy {strategy!r} is not one of {FULLY_SHARDED}")
        super().__init__()
        self.groups, self.strategy = groups, strategy
        self.specs = dict(specs) if specs is not None else collect_shard_specs(module)
        self.compute_dtype, self.is_last_stage = compute_dtype, is_last_stage
        # ZeRO-3 frees a layer's params after its forward, except under PP (module docstring)
        reshard = strategy == OPTIM_GRADS_PARAMS and groups.pp_size == 1
        mp = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
        if compute_dtype != torch.float32:  # DDP's master weights: its 16-bit params upcast (module docstring)
            round_params_to(module, compute_dtype)
        mesh = dp_mesh(groups)
        if hasattr(module, "compile_per_layer"):  # one chunk graph would be one unit, gathered whole (module docstring)
            module.compile_per_layer(COMPILE_BLOCKER)
        self._reshard, self.cpu_offload = reshard, cpu_offload
        # pinned host memory makes the shards' copies to the device asynchronous; a CPU-only build has none to pin
        offload = CPUOffloadPolicy(pin_memory=groups.device.type == "cuda") if cpu_offload else OffloadPolicy()
        # expert parallelism: each EP rank holds other experts, replicated over expert-DP: they shard there, as units
        # of their own inside their layer's (torchtitan shards MoE experts over its dp-mod-ep mesh the same way)
        if groups.ep_size > 1:
            expert_mesh = DeviceMesh.from_group(groups.edp_group, mesh.device_type)
            for experts in _expert_modules(module, self.specs):
                fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp,
                            offload_policy=offload)
        units = _units(module)
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        self._unit_params = {id(p) for unit in units for p in unit.parameters()}  # (sharded) the rest: the root's
        # the root: its params (final norm, a tied embedding) are used until the end of the forward
        fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
        self.module = module
        self._fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for m in self._fsdp_modules:
            m.set_gradient_divide_factor(1.0)  # a SUM over DP: finalize_model_grads normalises by the token count
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
        self._params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    # --- module passthrough ----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.is_last_stage and isinstance(out, torch.Tensor) and out.is_floating_point():
            out = out.float()  # the loss / logits in fp32, as Float16Module returns them
        return out

    # --- gradient sync ---------------------------------------------------------------------
    def _set_sync(self, sync: bool) -> None:
        root = self.module
        if self.groups.pp_size > 1:  # module docstring: keep the stage gathered, reduce once per step
            root.set_requires_gradient_sync(sync)
            root.set_reshard_after_backward(sync)
        elif self.cpu_offload:  # module docstring: reduce and offload once per step, the params still resharded
            root.set_requires_gradient_sync(sync)
        root.set_is_last_backward(sync)

    @contextlib.contextmanager
    def no_sync(self):
        """Around every backward but the last micro-batch's: FSDP does not finalise the step's reductions; under
        PP the params stay gathered and the grads accumulate unsharded (fp32), reduce-scattered after the last."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def start_grad_sync(self) -> None:
        """Nothing to launch: FSDP reduce-scatters each unit's grads in the backward."""

    def finish_grad_sync(self) -> None:
        """After the last backward every param's sharded grad is reduced (FSDP waited for it); a param that got no
        grad gets zeros, so that every rank passes the same tensors to the collectives that follow."""
        for _, param in self._params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    def named_main_grads(self) -> list:
        """[(name, sharded param, this rank's local grad shard)]: the grads after the DP reduction, shaped like the
        local param shard (rows of the TP-local tensor); in-place changes reach the param's grad."""
        return [(name, p, p.grad.to_local()) for name, p in self._params if p.grad is not None]

    def scale_gradients(self, factor) -> None:
        """Multiply every local grad shard by ``factor`` (a number or a 0-d tensor)."""
        for _, _, grad in self.named_main_grads():
            # offloaded shards: a device factor comes to the host (a 0-d CUDA tensor does not scale a host one)
            grad.mul_(factor.to(grad.device) if isinstance(factor, torch.Tensor) else factor)

    def zero_grad_buffer(self) -> None:
        """Drop every sharded grad (the next backward starts from none)."""
        for _, param in self._params:
            param.grad = None

    def dp_bytes_sent(self) -> tuple:
        """(bytes per micro-batch, bytes per iteration) this rank sends over DP, from the collectives' sizes (ring
        all-gather / reduce-scatter: (S − 1)/S of the whole tensor each over the shard group of S ranks; TP-local
        sizes). Without PP, per
        micro-batch: each unit's params gathered in the compute dtype before its forward (ZeRO-3: the units but the
        root again before their backward) and its fp32 grads reduce-scattered after its backward. Under PP, per
        iteration: one gather (the stage stays gathered) and one reduce-scatter."""
        shard, replicas = self.groups.dp_shard_size, self.groups.dp_replicate_size
        compute = self.compute_dtype.itemsize
        unit = sum(p.numel() for _, p in self._params if id(p) in self._unit_params)
        full = sum(p.numel() for _, p in self._params)
        gathered = (full + (unit if self._reshard else 0)) * compute
        sent = (gathered + full * 4) * (shard - 1) // shard
        # HSDP: the fp32 grad shards all-reduced across the replicas (ring: 2 (R − 1)/R of a shard)
        sent += 2 * (replicas - 1) * full * 4 // (shard * replicas)
        return (sent, 0) if self.groups.pp_size == 1 else (0, sent)

    # --- params ----------------------------------------------------------------------------
    def finish_param_sync(self) -> None:
        """Free every gathered param (ZeRO-2 keeps them after an evaluation's forward): whoever reads the params
        outside a training step (a checkpoint, the layout record) sees the sharded ones the optimizer steps."""
        for m in self._fsdp_modules:
            m.reshard()

    def start_param_sync(self, *args, **kwargs) -> None:
        raise RuntimeError("FullyShardedDataParallel: the params are gathered per layer by FSDP, not by the optimizer")

    def pending_param_syncs(self) -> list:
        return []

    def launched_buckets(self) -> list:
        return []
