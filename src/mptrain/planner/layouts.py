"""Enumerate valid layouts, estimate communication, bubble and step time, rank them.

Validity is the trainer's own: every candidate goes through `validate_config` and
`check_model_config` (a layout the planner lists is one `train.py` accepts). The checks no layout
changes run once first (`check_layout_free`), so a wrong key is reported as itself.

Communication (FORMULAS): bytes SENT per rank per optimizer step (one global batch), by group,
for ring collectives (an all-reduce of n bytes sends 2(k−1)/k·n per rank, a reduce-scatter or an
all-gather (k−1)/k·n). Reported for the busiest pipeline stage of each group.
    tp   per micro-batch and layer: 2 all-reduces forward + 2 backward of s·b·h activations (with SP
         the same volume as 4 all-gathers + 4 reduce-scatters; Korthikanti et al. 2022 §4.2.2);
         full recompute re-runs the 2 forward ones; + the embedding's forward all-reduce (first
         stage) and the output layer's backward all-reduce (last stage).
    pp   per micro-batch: one activation forward (not the last virtual stage) and one grad backward
         (not the first virtual stage) of s·b·h (/t under SP) in the activation dtype, per chunk.
    dp   all-reduce of the grad buffer; ZeRO-1: reduce-scatter of it + all-gather of the updated
         params in the buffer dtype (distrib_optimizer.py gathers a buffer-dtype scratch); ZeRO-2 / ZeRO-3:
         FSDP's per-layer all-gathers and reduce-scatters over the shard group, HSDP's all-reduce of the shards
         across the replicas (`fsdp_bytes`; counted on the step's critical path, prefetch overlap not modelled).
    embedding  tied embedding with pp > 1: all-reduce of its grad over the 2 stages.
    ep   MoE token dispatch over the etp × ep ranks, per MoE layer and micro-batch (`mptrain.planner.moe`).
    edp  ep > 1: the expert grads' buffer over the expert-data-parallel group, as dp (the dense part stays in dp).
    cp   per micro-batch and layer (context parallelism, `ring_bytes_per_layer`): the K/V of the rank's s/cp tokens
         (2·b·(s/cp)·(ng/t)·d in the activation dtype) hops cp − 1 times forward (again under full recompute)
         and cp − 1 times backward, and the fp32 dK/dV accumulator cp times (p2p; all_gather moves the same
         volume through its all-gather and reduce-scatter).
    The dense grads reduce over dp × cp (`dp` above uses that group's size).
Bubble (Narayanan et al. 2021 §2.2): (pp − 1) / (vpp·m + pp − 1) of the step.
Step time (ASSUMED hardware, `hardware.*`): FLOPs of DESIGN.md §2 (`mptrain.layers.params`; plus
the transformer layers' extra forward for full recompute, the attention-core forward for selective)
/ (GPUs × peak × assumed_mfu) / (1 − bubble) + TP time (never overlapped) + DP and expert-DP time (unless
overlap_grad_reduce) + PP time + the MoE dispatch's time (never overlapped), each at the bandwidth of its link
(intra-node when the group fits in one node of gpus_per_node), + the ring time a layer's attention does not
hide: per layer and micro-batch max(0, ring − attention), ring = `ring_bytes_per_layer` at the CP group's link,
attention = its FLOPs (12·h·s·(b·s)/(t·cp), forward and backward, causal counted in full as DESIGN.md §2) at the
assumed rate (`ring_vs_attention_s`).
Expert parallelism is searched too: for an MoE model every ep that divides num_moe_experts and that the trainer
accepts with the layout (the expert grid etp × ep × pp tiles the world; ep > 1 needs etp = tp).
CP candidates: cp = 1, the configured parallel.context_parallel_size, and every cp that leaves a rank at least
`CP_MIN_TOKENS` tokens of each sequence (shorter slices send ring messages too small to hide).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from mptrain.config.model import recompute_granularity
from mptrain.config.schema import as_config
from mptrain.training.validate import check_layout_free, derive_layout, validate_config
from mptrain.errors import ConfigError
from mptrain.layers.embedding import padded_vocab_size
from mptrain.layers.gpt import check_model_config
from mptrain.layers.params import active_parameters, count_parameters, flops_per_iteration
from mptrain.distributed.strategy import FULLY_SHARDED, NO_SHARD, OPTIM, OPTIM_GRADS_PARAMS, check_fully_sharded
from mptrain.planner.config import HardwareConfig
from mptrain.planner.memory import (GIB, PARAM_BYTES, PlanLayout, grad_bytes_per_element, planner_assumptions,
                                    stage_memory)
from mptrain.planner.moe import dispatch_bytes_per_layer, expert_data_parallel_size, is_moe_model, moe_layer_share
from mptrain.planner.params import all_rank_params

RECOMPUTE = ("none", "selective", "full")
CP_MIN_TOKENS = 4096
"""Tokens of each sequence a CP rank keeps at least for the planner to try that cp (module docstring)."""


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_config(cfg, layout: PlanLayout):
    """A copy of ``cfg`` (a `Config`) with the layout's parallel / recompute / schedule keys set."""
    c = copy.deepcopy(cfg)
    p = c.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = layout.tp, layout.pp
    p.context_parallel_size = layout.cp
    p.virtual_pipeline_model_parallel_size = layout.vpp
    p.use_distributed_optimizer, p.sequence_parallel = layout.use_distributed_optimizer, layout.sequence_parallel
    # ZeRO-2 / ZeRO-3 candidates carry their strategy, HSDP shard size and offload; the others none of them
    fsdp = layout.strategy in FULLY_SHARDED
    p.data_parallel_sharding_strategy = layout.strategy if fsdp else None
    p.data_parallel_shard_size = layout.shard_size if fsdp else None
    c.optim.optimizer_cpu_offload = layout.cpu_offload and fsdp
    p.expert_model_parallel_size = layout.ep
    p.name = (f"tp{layout.tp}" + (f"cp{layout.cp}" if layout.cp > 1 else "") + f"pp{layout.pp}"
              + (f"vpp{layout.vpp}" if layout.vpp else "") + (f"ep{layout.ep}" if layout.ep > 1 else ""))
    m = c.model
    m.recompute_granularity = None if layout.recompute == "none" else layout.recompute
    m.recompute_activations = False  # the layout's granularity is the whole choice
    m.recompute_method = "uniform" if layout.recompute == "full" else None
    m.recompute_num_layers = (m.recompute_num_layers or 1) if layout.recompute == "full" else None
    # the configured schedule stays (auto by default): validate_config resolves it per layout, and a
    # layout it rejects (e.g. vpp with schedule=1f1b) is not one train.py would run
    return c


def config_layout(cfg, derived) -> PlanLayout:
    """The `PlanLayout` a validated config runs (``derived``: its `mptrain.training.validate.DerivedLayout`): the
    layout keys, recomputation, data-parallel strategy, HSDP shard size and offload as configured."""
    p = cfg.parallel
    return PlanLayout(derived.tensor_model_parallel_size, derived.pipeline_model_parallel_size,
                      derived.virtual_pipeline_model_parallel_size, derived.data_parallel_size,
                      p.use_distributed_optimizer, recompute_granularity(cfg.model) or "none",
                      derived.sequence_parallel, derived.schedule, derived.num_microbatches,
                      ep=derived.expert_model_parallel_size, edp=derived.expert_data_parallel_size,
                      cp=derived.context_parallel_size, strategy=p.data_parallel_sharding_strategy,
                      shard_size=p.data_parallel_shard_size, cpu_offload=cfg.optim.optimizer_cpu_offload)


def expert_parallel_options(cfg, world_size: int) -> list:
    """The ``expert_model_parallel_size`` values to try: the divisors of ``model.num_moe_experts`` that divide the
    world (1 alone for a dense model); the trainer's checks then keep those the layout takes."""
    if not is_moe_model(cfg.model):
        return [1]
    return [d for d in _divisors(cfg.model.num_moe_experts) if world_size % d == 0]


def cp_options(cfg, world_size: int) -> list:
    """The context-parallel sizes the planner tries (module docstring): 1, the configured one, and each divisor of
    the world that leaves a rank `CP_MIN_TOKENS` tokens of each sequence."""
    s = cfg.model.seq_length
    long = {d for d in _divisors(world_size) if d > 1 and s // d >= CP_MIN_TOKENS}
    return sorted({1, cfg.parallel.context_parallel_size} | long)


def sharding_options(cfg) -> list:
    """(use_distributed_optimizer, strategy) pairs the search tries: DDP and ZeRO-1, and the configured ZeRO-2 /
    ZeRO-3 strategy when ``parallel.data_parallel_sharding_strategy`` names one (with its HSDP shard size and
    offload): sharding params and grads trades step time for memory, a choice the user opts into."""
    options = [(False, None), (True, None)]
    strategy = cfg.parallel.data_parallel_sharding_strategy
    return options + [(False, strategy)] if strategy in FULLY_SHARDED else options


def candidate_layouts(cfg, world_size: int, *, vpp_options=(2, 4), sequence_parallel=(False, True)) -> list:
    """Every (tp, cp, pp, vpp, ep, data-parallel strategy (`sharding_options`), recompute, SP) the trainer accepts
    at ``world_size``.

    Raises:
        ConfigError: a key no layout changes is wrong (`check_layout_free`, run once for all candidates).
    """
    cfg = as_config(cfg)
    loss_scaler = check_layout_free(cfg)
    out = []
    for tp, cp, pp, vpp, ep in _grid(world_size, vpp_options, cp_options(cfg, world_size),
                                     expert_parallel_options(cfg, world_size)):
        dp = world_size // (tp * cp * pp)
        for distopt, strategy in sharding_options(cfg):
            for recompute in RECOMPUTE:
                for sp in sequence_parallel:
                    probe = PlanLayout(tp, pp, vpp, dp, distopt, recompute, sp, "auto", 0, ep=ep, cp=cp,
                                       strategy=strategy, shard_size=cfg.parallel.data_parallel_shard_size,
                                       cpu_offload=cfg.optim.optimizer_cpu_offload)
                    # nothing to shard at dp × cp = 1 (ZeRO-3 with offload excepted: the shards leave the GPU)
                    if (sp and tp == 1) or ((distopt or strategy) and probe.sharding in (NO_SHARD, OPTIM)
                                            and dp * cp == 1):
                        continue
                    c = layout_config(cfg, probe)
                    try:
                        derived = derive_layout(c, world_size, loss_scaler=loss_scaler)
                        check_model_config(c.model, c.parallel)
                        check_fully_sharded(c)  # what ZeRO-2 / ZeRO-3 refuse with this layout's keys (cp shards too)
                    except ConfigError:
                        continue
                    out.append(dataclasses.replace(probe, schedule=derived.schedule,
                                                   num_microbatches=derived.num_microbatches,
                                                   edp=derived.expert_data_parallel_size))
    return out


def _grid(world_size: int, vpp_options, cp_options, ep_options) -> list:
    """(tp, cp, pp, vpp, ep) of the search: tp × cp × pp dividing the world (cp from ``cp_options``), vpp for
    pp > 1, ep from ``ep_options``."""
    return [(tp, cp, pp, vpp, ep) for tp in _divisors(world_size) for pp in _divisors(world_size // tp)
            for cp in cp_options if world_size % (tp * pp * cp) == 0
            for vpp in (None, *(v for v in vpp_options if pp > 1)) for ep in ep_options]


def bubble_fraction(layout: PlanLayout) -> float:
    """(pp − 1) / (vpp·m + pp − 1): idle share of a step (0 without pipelining)."""
    if layout.pp == 1:
        return 0.0
    if layout.schedule == "gpipe" or layout.schedule == "1f1b":
        return (layout.pp - 1) / (layout.num_microbatches + layout.pp - 1)
    return (layout.pp - 1) / ((layout.vpp or 1) * layout.num_microbatches + layout.pp - 1)


def _ring(k: int) -> float:
    return (k - 1) / k if k > 1 else 0.0


def comm_bytes(cfg, layout: PlanLayout, *, vocab_size: int, ranks: list) -> dict:
    """Bytes sent per rank per step by group (module docstring); max over pipeline stages."""
    m = cfg.model
    s, b, h = m.seq_length, cfg.train.micro_batch_size, m.hidden_size
    act = PARAM_BYTES[cfg.precision.name]
    mb, t, v = layout.num_microbatches, layout.tp, layout.vpp or 1
    sbh_bytes = s * b * h * act
    per_layer = (4 + (2 if layout.recompute == "full" else 0)) * 2 * _ring(t) * sbh_bytes
    p2p = sbh_bytes / (t if layout.sequence_parallel else 1)
    grad_b = grad_bytes_per_element(cfg)
    dispatch = dispatch_bytes_per_layer(cfg, tp=t, ep=layout.ep, act_bytes=act, recompute=layout.recompute)
    ring = ring_bytes_per_layer(cfg, layout)
    out = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "embedding": 0.0, "ep": 0.0, "edp": 0.0, "cp": 0.0}
    for r, rp in enumerate(ranks):
        tp_bytes = mb * (len(rp.layers) * per_layer + 2 * _ring(t) * sbh_bytes * (rp.has_embedding + rp.has_output))
        chunks_fwd = layout.pp * v - 1  # virtual stages that send forward: all but the last
        sends = 0
        for c in range(v):
            virtual = c * layout.pp + r
            sends += (virtual < chunks_fwd) + (virtual > 0)
        pp_bytes = mb * sends * p2p if layout.pp > 1 else 0.0
        experts = rp.expert_numel if layout.ep > 1 else 0  # their own buffers, over expert-DP
        # all-reduce: 2(d-1)/d; ZeRO-1: reduce-scatter (d-1)/d + all-gather (d-1)/d, both in the buffer dtype
        dp_bytes = 2 * _ring(layout.dp * layout.cp) * (rp.numel - experts) * grad_b  # dense grads: over dp × cp
        if layout.fully_sharded:
            dp_bytes = fsdp_bytes(cfg, layout, rp.numel)
        edp_bytes = 2 * _ring(layout.expert_dp) * experts * grad_b
        ep_bytes = mb * len(rp.layers) * moe_layer_share(m, rp.layers) * dispatch
        emb = 0.0
        if layout.pp > 1 and not m.untie_embeddings_and_output_weights and (rp.has_embedding or rp.has_output):
            emb = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, t) // t * h * grad_b
        cp_bytes = mb * len(rp.layers) * ring
        for key, val in (("tp", tp_bytes), ("pp", pp_bytes), ("dp", dp_bytes), ("embedding", emb), ("ep", ep_bytes),
                         ("edp", edp_bytes), ("cp", cp_bytes)):
            out[key] = max(out[key], float(val))
    return out


def fsdp_bytes(cfg, layout: PlanLayout, numel: int) -> float:
    """Bytes a ZeRO-2 / ZeRO-3 rank sends over DP per step (module docstring; as
    `mptrain.distributed.fsdp.FullyShardedDataParallel.dp_bytes_sent`): per micro-batch without PP (once per step
    under PP, the stage staying gathered), each unit's params all-gathered in the compute dtype (ZeRO-3: again for
    the backward) and its fp32 grads reduce-scattered, (S − 1)/S of each over the shard group of S ranks; HSDP adds
    the all-reduce of the fp32 grad shards over the R = dp·cp / S replicas, 2 (R − 1)/R of N / S."""
    compute = PARAM_BYTES[cfg.precision.name]
    shard = layout.shard
    replicas = layout.dp * layout.cp // shard
    gathers = 2 if layout.sharding == OPTIM_GRADS_PARAMS and layout.pp == 1 else 1
    per = (gathers * compute + 4) * numel * _ring(shard) + 2 * _ring(replicas) * numel * 4 / shard
    return per * (layout.num_microbatches if layout.pp == 1 else 1)


def ring_bytes_per_layer(cfg, layout: PlanLayout) -> float:
    """Bytes a CP rank sends per layer per micro-batch, forward and backward (module docstring); 0 at cp = 1."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    m = cfg.model
    heads = m.num_attention_heads
    d = m.kv_channels or m.hidden_size // heads
    kv_elements = 2 * cfg.train.micro_batch_size * (m.seq_length // cp) * (m.num_query_groups or heads) // layout.tp * d
    act = PARAM_BYTES[cfg.precision.name]
    forwards = 2 if layout.recompute == "full" else 1
    return (forwards + 1) * (cp - 1) * kv_elements * act + cp * kv_elements * 4


def ring_vs_attention_s(cfg, layout: PlanLayout, hw: HardwareConfig) -> tuple[float, float]:
    """(ring seconds, attention seconds) per layer per micro-batch on a rank (module docstring); (0, 0) at cp = 1."""
    if layout.cp == 1:
        return 0.0, 0.0
    m = cfg.model
    s, b, h = m.seq_length, cfg.train.micro_batch_size, m.hidden_size
    attention = 12 * h * s * (b * s) / (layout.tp * layout.cp) / (hw.peak_tflops * 1e12 * hw.assumed_mfu)
    return ring_bytes_per_layer(cfg, layout) / _bandwidth(hw, layout.tp * layout.cp), attention


def step_flops(cfg, layout: PlanLayout, *, vocab_size: int) -> int:
    """FLOPs of one iteration of ``layout``, recomputation included (`mptrain.layers.params.flops_per_iteration`)."""
    m = cfg.model
    v_pad = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, layout.tp)
    return flops_per_iteration(m, padded_vocab_size=v_pad, tokens_per_iteration=cfg.train.global_batch_size * m.seq_length,
                               recompute=layout.recompute)


def _bandwidth(hw: HardwareConfig, group_span: int) -> float:
    return (hw.intra_node_gb_per_s if group_span <= hw.gpus_per_node else hw.inter_node_gb_per_s) * 1e9


def step_time_s(cfg, layout: PlanLayout, comm: dict, hw: HardwareConfig, *, vocab_size: int) -> float:
    """Assumed-hardware step time (module docstring); for ranking, not a measurement."""
    world = layout.tp * layout.cp * layout.pp * layout.dp
    compute = step_flops(cfg, layout, vocab_size=vocab_size) / (world * hw.peak_tflops * 1e12 * hw.assumed_mfu)
    compute /= 1.0 - bubble_fraction(layout)
    # TP ranks are adjacent, CP ranks stride tp, DP ranks tp·cp, PP ranks tp·cp·dp (groups.py rank order).
    tp_time = comm["tp"] / _bandwidth(hw, layout.tp)
    dp_span = layout.tp * layout.cp * layout.dp
    dp_time = 0.0 if cfg.parallel.overlap_grad_reduce else (comm["dp"] + comm["edp"]) / _bandwidth(hw, dp_span)
    pp_time = comm["pp"] / _bandwidth(hw, world)
    # the expert grid's tp_ep group: etp × ep adjacent ranks (etp fastest, then ep; groups.py)
    etp = cfg.parallel.expert_tensor_parallel_size or layout.tp
    ep_time = comm["ep"] / _bandwidth(hw, etp * layout.ep)
    ring, attention = ring_vs_attention_s(cfg, layout, hw)
    layers = cfg.model.num_layers / layout.pp
    cp_time = layout.num_microbatches * layers * max(0.0, ring - attention)  # what the attention does not hide
    return compute + tp_time + dp_time + pp_time + ep_time + cp_time


FIT_ORDER = ("yes", "tight", "no")
"""`fit_verdict`'s answers, in the ranking's order."""


def fit_verdict(total_gib: float, hw: HardwareConfig) -> str:
    """``yes``: the planned total leaves ``hardware.memory_headroom_gib`` free; ``tight``: it fits the GPU only by
    eating into that headroom (the CUDA context, NCCL buffers and fragmentation the formulas leave out may not
    fit); ``no``: above ``hardware.gpu_memory_gib``."""
    if total_gib <= hw.gpu_memory_gib - hw.memory_headroom_gib:
        return "yes"
    return "tight" if total_gib <= hw.gpu_memory_gib else "no"


def plan_layout(cfg, layout: PlanLayout, hw: HardwareConfig, *, vocab_size: int) -> dict:
    """One JSON record: layout keys (ep and edp: the expert grid's expert-parallel and expert-data-parallel sizes),
    memory_gib (parts of the peak stage + total), fits (with the headroom kept), tight (fits the GPU only within
    the headroom: `fit_verdict`), bubble, comm, ``parameters`` (``total``: every expert counted; ``active``: the
    weights one token uses, what FLOPs and MFU count; equal for a dense model) and ``assumptions`` (lines: what the
    numbers assume for a user optimizer or schedule, or an MoE model's routing; empty for built-ins)."""
    if layout.ep > 1 and layout.edp is None:  # a layout given by hand: its expert-DP size from the grid
        layout = dataclasses.replace(layout, edp=expert_data_parallel_size(cfg, tp=layout.tp, pp=layout.pp,
                                                                           dp=layout.dp, ep=layout.ep))
    c = layout_config(cfg, layout)
    ranks = all_rank_params(c.model, c.parallel, vocab_size=vocab_size)
    stages = [stage_memory(c, layout, rp, pp_rank=r, vocab_size=vocab_size) for r, rp in enumerate(ranks)]
    peak_stage = max(range(len(stages)), key=lambda r: stages[r].total)
    comm = comm_bytes(c, layout, vocab_size=vocab_size, ranks=ranks)
    total_gib = stages[peak_stage].total / GIB
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "dp": layout.dp,
        "ep": layout.ep,
        "edp": layout.expert_dp,
        "cp": layout.cp,
        "use_distributed_optimizer": layout.use_distributed_optimizer,
        "data_parallel_sharding_strategy": layout.sharding,
        "data_parallel_shard_size": layout.shard if layout.fully_sharded else None,
        "optimizer_cpu_offload": layout.fully_sharded and layout.cpu_offload,
        "recompute": layout.recompute,
        "sequence_parallel": layout.sequence_parallel,
        "schedule": layout.schedule,
        "num_microbatches": layout.num_microbatches,
        "memory_gib": stages[peak_stage].gib(),
        "peak_stage": peak_stage,
        "stage_total_gib": [st.total / GIB for st in stages],
        "fits": fit_verdict(total_gib, hw) == "yes",
        "tight": fit_verdict(total_gib, hw) == "tight",
        "bubble_fraction": bubble_fraction(layout),
        "comm_bytes": comm,
        "step_time_s": step_time_s(c, layout, comm, hw, vocab_size=vocab_size),
        "parameters": {"total": count_parameters(c.model, vocab_size=vocab_size),
                       "active": active_parameters(c.model, vocab_size=vocab_size)},
        "cp_ring_vs_attention_s": list(ring_vs_attention_s(c, layout, hw)),
        "assumptions": planner_assumptions(c, layout),
    }


def plan(cfg, world_size: int, hw: HardwareConfig, *, vocab_size: int, layouts: Optional[list] = None) -> list:
    """Records for every valid layout, ranked: fitting first, then tight ones (`fit_verdict`), then estimated step
    time, then bubble.

    Raises:
        ConfigError: a key no layout changes is wrong (`check_layout_free`), or no layout of ``world_size``
            passes validation (the message names the keys).
    """
    cfg = as_config(cfg)
    if layouts is None:
        layouts = candidate_layouts(cfg, world_size)  # runs check_layout_free once, before any candidate
    else:
        check_layout_free(cfg)
    if not layouts:
        validate_config(cfg, world_size, world_size_flag="world_size")  # the trainer's own message, for this layout
        raise ConfigError(
            f"plan: no tp × pp × vpp layout of world_size={world_size} passes validation for model={cfg.model.name} "
            f"(train.global_batch_size={cfg.train.global_batch_size}, micro_batch_size={cfg.train.micro_batch_size}); "
            f"change world_size or the batch sizes"
        )
    records = [plan_layout(cfg, lay, hw, vocab_size=vocab_size) for lay in layouts]
    # offload after the layouts that fit as well without it: its step time leaves out the host's part
    # (OFFLOAD_ASSUMPTION)
    return sorted(records, key=lambda r: (not r["fits"], not r["tight"], r["optimizer_cpu_offload"], r["step_time_s"],
                                          r["bubble_fraction"], r["memory_gib"]["total"]))
