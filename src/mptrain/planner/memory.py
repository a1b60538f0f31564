"""Per-GPU memory of one layout: model states (formulas) + activations (formula with measured constants).

Units: bytes everywhere in this module (the report converts to GiB = 2**30 bytes).
Legend: s = seq_length / context_parallel_size (the tokens of each sequence a rank holds; CP keeps no s × s
term: the ring attention saves q, k, v, out and the log-sum-exp as SDPA does), b = micro_batch_size, h = hidden_size,
a = num_attention_heads,
t = tensor_model_parallel_size, V = padded vocab, N_r = parameter elements of rank r (`params.py`).

Model states (FORMULAS; exact for what `training/run.py::build_model_and_optimizer` allocates):
    weights         N_r × bytes(precision)                    (Float16Module casts to bf16/fp16)
                    + precision=fp8, tensorwise: 2 bytes per weight element of each block linear in FP8
                    (the size rule, `fp8_linears`) of the rank's FP8 layers (the weight's cast and its
                    transpose, made once per iteration, `mptrain.layers.fp8.Fp8WeightCast`; 1 byte under
                    fp8_emulate); none under ZeRO-2 / ZeRO-3, where each GEMM casts the gathered weight
    grads           N_r × bytes(grad dtype)                   fp32 when grad_reduce_in_fp32 or the
                                                              params are bf16/fp16 (run.py), else fp32
    main params     N_r × 4 (bf16/fp16: MixedPrecisionOptimizer copies; fp32: none, stepped in place)
                    N_r × 4 / dp with the distributed optimizer (ZeRO-1 pieces, fp32 for every precision)
    optimizer state Adam/AdamW: 2 fp32 per main element (exp_avg, exp_avg_sq) = 8 × (N_r or N_r/dp);
                    SGD: 4 × ... with momentum, 0 without; read from ``optim._target_``; another class:
                    assumed 2 (noted in the plan). (Rajbhandari et al. 2020, ZeRO §3: 2+2+12 bytes.)
    ZeRO-2 / ZeRO-3 (``parallel.data_parallel_sharding_strategy`` optim_grads / optim_grads_params, FSDP2): each
                    rank holds N_r / S of every part, S = the shard group (dp × cp, or
                    ``parallel.data_parallel_shard_size`` under HSDP): weights = the fp32 shards (also the master
                    weights: no main params), grads = their fp32 reduced shards, optimizer state of N_r / S
                    elements (torch.chunk's uneven rows: < S rows per tensor more on the first ranks, ignored).
                    With ``optim.optimizer_cpu_offload`` the three live in host memory (`MemoryParts.offloaded`).
                    MoE under ep > 1: the rank's expert elements X_r shard over expert-DP instead, (N_r − X_r)/S +
                    X_r/edp.
    gathered (FSDP's unsharded params at the peak, planned only): ZeRO-2 or pp > 1: N_r × bytes(compute)
                    (every layer stays gathered from its forward to its backward; under PP across the stage's
                    micro-batches, whose grads also accumulate unsharded: + N_r × 4); ZeRO-3 without PP: two
                    units (the one computing and the one prefetched) and the root unit (the tied embedding of a
                    one-stage chunk) in the compute dtype, plus one unit's unsharded fp32 grad before its
                    reduce-scatter; a unit = the largest of a transformer layer and the embedding. CPU offload
                    with m > 1 micro-batches (no PP): the grads accumulate unsharded on the device, + N_r × 4
                    (ZeRO-3: in place of the one unit's grad).
    Bucket padding (< dp elements per bucket) and Adam's scalar `step` tensors are ignored (< 0.01 %).
    Expert parallelism (ep > 1): the rank's routed-expert elements X_r (`RankParams.expert_numel`, E/ep experts
    per MoE layer) are sharded by ZeRO-1 over the expert-data-parallel group instead: main params and optimizer
    state of (N_r − X_r)/dp + X_r/edp elements.

Activations per micro-batch per transformer layer (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", arXiv 2205.05198, §4.1 eq. 1-2 and Table 2):
    paper, 16-bit, no parallelism:   s·b·h·(34 + 5·a·s/h)
      with TP:                       s·b·h·(10 + 24/t + 5·a·s/(h·t))
      with TP + SP:                  s·b·h·(34 + 5·a·s/h) / t
      selective recompute (TP+SP):   s·b·h·34 / t               full recompute: 2·s·b·h (layer input)
    OUR layer (MEASURED on CPU, `MEASURED` below; test_plan_activations.py re-measures them): it
    uses fused SDPA attention (no a·s² term: only a fp32 logsumexp, 4·a·s·b/t bytes) and keeps no
    dropout masks at dropout 0, so in units of s·b·h × bytes(activation)/2:
        norm inputs, replicated over TP (split under SP):       4
        QKV / fc1 inputs, replicated over TP, also under SP:    4   (our column-parallel linear saves
                                                                     the all-gathered input; Megatron
                                                                     saves the shard and re-gathers)
        split over TP:                  S = 8 + M·f/h  (attention: q/k/v, views of the QKV output,
                                                 one torch.split in attention.py, saved once, and
                                                 the context: 8, also with grouped-query attention,
                                                 whose k/v SDPA reads expanded; MLP per f/h: GELU 4
                                                 (fc1 out, GELU out), SwiGLU 8 (fc1 out [gate; up],
                                                 silu(gate), their product)). f = 4h, GELU: S = 24.
        selective recompute:            S as above (the attention core's saved q/k/v/out dropped)
        hidden dropout > 0:             two masks of s·b·h (/t under SP): 1 byte each on CUDA
                                        (native_dropout's bool mask, as the paper); CPU's dropout
                                        saves the mask in the activation dtype (measured)
        full recompute:                 2 per checkpointed group (its input; /t under SP), plus one
                                        group's full activations while it is recomputed (transient)
        precision=fp8, tensorwise:      the linears save their input's FP8 cast (1 byte an element)
                                        instead of the bf16 input, and of the weight's cast only the
                                        scale (`mptrain.layers.fp8.Fp8Gemms.forward`): QKV / fc1
                                        inputs 4 -> 2; S: fc2's input −f/h (GELU at f = 4h: 8 -> 4),
                                        the proj input's 1-byte cast +1 (beside the context SDPA keeps).
                                        Rowwise recipes save the bf16 inputs (their weight-grad casts
                                        scale along tokens): as bf16. Layers kept in bf16
                                        (precision.fp8_first_last_layers_bf16) are weighted in per
                                        pipeline stage (the stage's share of FP8 layers), and
                                        a linear the size rule keeps bf16 saves its bf16 input
                                        (`fp8_linears`, `FP8_TENSORWISE_16BIT_DELTA`).
    MoE layers (`mptrain.planner.moe`, MEASURED too): the router's input, scores and permutation, the experts'
    rows and intermediates for the routed rows (uniform routing) and the shared expert, in place of the
    dense fc1 input and MLP split term; a stage's layers are weighted by their MoE share.
Logits (last stage; read from layers/cross_entropy.py): the fp32 softmax saved for backward,
4·s·b·V/t per in-flight micro-batch, plus a transient (bytes(activation) + 4)·s·b·V/t during the
cross-entropy forward (the logits and one fp32 temporary alive at once); the final norm's input and
output, 2 × bytes(activation)·s·b·h.

In-flight micro-batches (schedules/): no_pipelining 1; GPipe m; 1F1B stage r: min(pp − r, m)
(Narayanan et al. 2021 §2.2.1); interleaved stage r: min(2·(pp − r − 1) + (vpp − 1)·pp + 1, m·vpp)
chunk-micro-batches of L/(pp·vpp) layers each (Megatron's warmup count; §2.2.2); a user schedule
(the resolved schedule is its dotted path): assumed m, as GPipe (noted in the plan).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from mptrain import components
from mptrain.distributed.strategy import FULLY_SHARDED, NO_SHARD, OPTIM, OPTIM_GRADS_PARAMS
from mptrain.layers.embedding import padded_vocab_size
from mptrain.layers.fp8 import fp8_recipe_from, gemm_runs_in_fp8
from mptrain.layers.params import layer_linear_shapes
from mptrain.planner.moe import MOE_MEASURED, moe_layer_share, moe_mlp_activation_bytes
from mptrain.planner.params import RankParams

GIB = 2**30
PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}  # fp8: bf16 params and activations
# FORMULA (module docstring): what one block linear computing in tensorwise FP8 changes in the 16-bit units of
# `MEASURED`: QKV and fc1 save their input's 1-byte cast (2 -> 1 each), fc2 its input's (the activation's
# output: -f/h, GELU at f = 4h 8 -> 4), proj saves its input's cast beside the context SDPA keeps (+1). All
# four at f = 4h: linear inputs 4 -> 2, S 24 -> 21.
FP8_TENSORWISE_16BIT_DELTA = {  # linear name: (linear_inputs_16bit, split_16bit; fc2's per f/h)
    "qkv": (-1.0, 0.0), "proj": (0.0, 1.0), "fc1": (-1.0, 0.0), "fc2": (0.0, -1.0)}

# MEASURED on CPU (torch 2.13, saved-tensor hooks, unique storages) for our TransformerLayer: bytes
# saved for backward per layer per s·b·h element in 16-bit (bf16); fp32 measures exactly 2× these.
# Source of the numbers: tests/test_plan_activations.py::measure_saved_bytes (tiny, h 64, a 4, s 32).
MEASURED = {
    "norm_inputs_16bit": 4.0,  # the two norms' inputs: replicated over TP, split under SP
    "linear_inputs_16bit": 4.0,  # QKV and fc1 inputs: replicated over TP, full size (gathered) under SP too
    "split_attention_16bit": 8.0,  # QKV output (q/k/v views of it) and the context; the same with GQA
    "split_selective_attention_16bit": 8.0,  # selective recompute: the core attention's saved tensors dropped
    "split_mlp_per_ffn_16bit": {"gelu": 4.0, "swiglu": 8.0},  # × f/h: fc1 out and what the activation saves
    "hidden_dropout_masks": 2.0,  # masks per layer when hidden_dropout > 0 (× mask bytes per element)
}
CUDA_DROPOUT_MASK_BYTES = 1  # FORMULA: torch's CUDA native_dropout saves a bool mask (Korthikanti et al. §4.1)


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """One candidate layout (what the planner varies)."""

    tp: int
    pp: int
    vpp: Optional[int]
    dp: int
    use_distributed_optimizer: bool
    recompute: str  # none | selective | full
    sequence_parallel: bool
    schedule: str
    num_microbatches: int
    ep: int = 1
    """expert_model_parallel_size: ranks that split each MoE layer's experts."""
    edp: Optional[int] = None
    """The expert-data-parallel size (`mptrain.planner.moe.expert_data_parallel_size`); None = dp."""
    cp: int = 1
    """context_parallel_size: each rank keeps s/cp tokens of every sequence; ZeRO-1 shards over dp × cp."""
    strategy: Optional[str] = None
    """parallel.data_parallel_sharding_strategy: optim_grads / optim_grads_params (FSDP2); None = the two above
    (optim with use_distributed_optimizer, else no_shard)."""
    shard_size: Optional[int] = None
    """parallel.data_parallel_shard_size (HSDP's shard group); None = dp × cp."""
    cpu_offload: bool = False
    """optim.optimizer_cpu_offload: the FSDP shards in host memory."""

    @property
    def sharding(self) -> str:
        """The strategy that runs (`mptrain.distributed.strategy.running_strategy`: FSDP at dp = 1 only with
        offload)."""
        if self.strategy in FULLY_SHARDED and (self.dp * self.cp > 1 or self.cpu_offload):
            return self.strategy
        return OPTIM if self.use_distributed_optimizer else NO_SHARD

    @property
    def fully_sharded(self) -> bool:
        return self.sharding in FULLY_SHARDED

    @property
    def shard(self) -> int:
        """S: the ranks a ZeRO-2 / ZeRO-3 param is sharded over."""
        return self.shard_size or self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """The group the expert-parallel weights' grads reduce over (dp where the experts are not split)."""
        return self.edp or self.dp


@dataclasses.dataclass(frozen=True)
class MemoryParts:
    """Bytes of one rank. `total` (device memory) = model states − offloaded + gathered + max(activations + logits,
    optimizer_workspace)."""

    weights: float
    grads: float
    main_params: float
    optimizer_state: float
    activations: float
    logits: float
    optimizer_workspace: float
    gathered: float = 0.0
    """ZeRO-2 / ZeRO-3: FSDP's unsharded params (and grads) at the peak (module docstring)."""
    offloaded: float = 0.0
    """Of the model states, the bytes in host memory (``optim.optimizer_cpu_offload``)."""

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.main_params + self.optimizer_state

    @property
    def total(self) -> float:
        return (self.model_states - self.offloaded + self.gathered
                + max(self.activations + self.logits, self.optimizer_workspace))

    def gib(self) -> dict:
        parts = {k: v / GIB for k, v in dataclasses.asdict(self).items()}
        parts["total"] = self.total / GIB
        return parts


def grad_bytes_per_element(cfg) -> int:
    """Grad buffer dtype as run.py picks it: fp32 under grad_reduce_in_fp32 or for bf16/fp16 params."""
    if cfg.parallel.grad_reduce_in_fp32 or cfg.precision.name != "fp32":
        return 4
    return PARAM_BYTES[cfg.precision.name]


def optimizer_states_per_element(cfg) -> tuple[int, Optional[str]]:
    """fp32 state tensors of the shape of a main param that the inner optimizer ``optim._target_`` keeps,
    and the assumption made (None when the class is known).

    Known (the imported class or a subclass): torch.optim.Adam / AdamW 2 (exp_avg, exp_avg_sq);
    torch.optim.SGD 1 (momentum_buffer) when its momentum (``optim.sgd_momentum``, or a user's
    ``+optim.momentum``) is > 0, else 0. Any other class: assumed 2, as Adam (the note says so).

    Raises:
        ConfigError: ``optim._target_`` does not import (the trainer's own message).
    """
    target = components.import_target("optim", cfg.optim._target_)
    if isinstance(target, type) and issubclass(target, (torch.optim.Adam, torch.optim.AdamW)):
        return 2, None
    if isinstance(target, type) and issubclass(target, torch.optim.SGD):
        momentum = components.extra_keys(cfg.optim).get("momentum", cfg.optim.sgd_momentum)
        return (1 if momentum else 0), None
    return 2, (f"optimizer state: optim._target_={cfg.optim._target_} is not Adam/AdamW/SGD; assumed 2 fp32 "
               "states per parameter element (as Adam)")


def optimizer_state_bytes_per_element(cfg) -> int:
    """Inner optimizer state bytes per main element: 4 × `optimizer_states_per_element` (fp32 states)."""
    return 4 * optimizer_states_per_element(cfg)[0]


def model_state_bytes(cfg, layout: PlanLayout, rp: RankParams) -> dict:
    """weights, grads, main_params, optimizer_state (bytes) of one rank, wherever they live (module docstring)."""
    n = rp.numel
    if layout.fully_sharded:  # FSDP's fp32 shards are the params the optimizer steps
        experts = rp.expert_numel if layout.ep > 1 else 0  # ep > 1: the experts shard over expert-DP
        owned = (n - experts) / layout.shard + experts / layout.expert_dp
        return {"weights": owned * 4, "grads": owned * 4, "main_params": 0.0,
                "optimizer_state": owned * optimizer_state_bytes_per_element(cfg)}
    half = cfg.precision.name != "fp32"
    owned = n
    if layout.use_distributed_optimizer:
        # ZeRO-1 shards the dense weights over dp × cp; ep > 1: the expert-parallel ones over expert-DP
        experts = rp.expert_numel if layout.ep > 1 else 0
        owned = (n - experts) / (layout.dp * layout.cp) + experts / layout.expert_dp
    main = owned * 4 if (half or layout.use_distributed_optimizer) else 0.0
    return {
        "weights": n * PARAM_BYTES[cfg.precision.name] + fp8_weight_cast_bytes(cfg, layout, rp),
        "grads": n * grad_bytes_per_element(cfg),
        "main_params": main,
        "optimizer_state": owned * optimizer_state_bytes_per_element(cfg),
    }


def fsdp_unit_elements(cfg, layout: PlanLayout, rp: RankParams, *, vocab_size: int) -> tuple[float, float]:
    """(largest FSDP unit, root unit) in elements of one rank: a unit is a transformer layer or the embedding /
    output layer (`mptrain.distributed.fsdp`); the root keeps the word embedding of a one-stage tied chunk."""
    m = cfg.model
    vocab = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, layout.tp) // layout.tp * m.hidden_size
    tied = not m.untie_embeddings_and_output_weights
    emb = vocab * (rp.has_embedding + (rp.has_output and not tied))
    layer = (rp.numel - emb) / max(1, len(rp.layers))
    root = vocab if tied and rp.has_embedding and rp.has_output else 0.0
    return max(layer, vocab if emb else 0.0), root


def gathered_bytes(cfg, layout: PlanLayout, rp: RankParams, *, vocab_size: int) -> float:
    """FSDP's unsharded params (and grads) at the peak of a step, bytes (module docstring); 0 without ZeRO-2 / 3."""
    if not layout.fully_sharded:
        return 0.0
    compute = PARAM_BYTES[cfg.precision.name]
    if layout.pp > 1:  # the stage stays gathered over its micro-batches; grads accumulate unsharded in fp32
        return rp.numel * (compute + 4)
    # CPU offload with gradient accumulation: the grads accumulate unsharded in fp32 on the device
    accumulated = rp.numel * 4 if layout.cpu_offload and layout.num_microbatches > 1 else 0.0
    if layout.sharding != OPTIM_GRADS_PARAMS:  # ZeRO-2: every layer gathered from its forward to its backward
        return rp.numel * compute + accumulated
    unit, root = fsdp_unit_elements(cfg, layout, rp, vocab_size=vocab_size)
    return (2 * unit + root) * compute + max(unit * 4, accumulated)


def _interleaved_inflight(pp: int, vpp: Optional[int], m: int, pp_rank: int) -> int:
    v = vpp or 1
    if m == pp:  # Megatron: all forwards first when m == pp
        return m * v
    return min(2 * (pp - pp_rank - 1) + (v - 1) * pp + 1, m * v)


# In-flight micro-batches of the built-in schedules, keyed by the name the resolved schedule has
# (`DerivedLayout.schedule`, `mptrain.schedules.schedule_name`): the formulas of the module docstring.
INFLIGHT = {
    "no_pipelining": lambda pp, vpp, m, pp_rank: 1,
    "gpipe": lambda pp, vpp, m, pp_rank: m,
    "1f1b": lambda pp, vpp, m, pp_rank: min(pp - pp_rank, m),
    "interleaved_1f1b": _interleaved_inflight,
}


def schedule_assumption(schedule: str) -> Optional[str]:
    """The note for a schedule without an in-flight formula (a user's: its dotted path); None for a built-in."""
    if schedule in INFLIGHT:
        return None
    return f"schedule: {schedule} has no in-flight formula here; assumed GPipe's (all m micro-batches in flight)"


def inflight_microbatches(schedule: str, *, pp: int, vpp: Optional[int], m: int, pp_rank: int) -> int:
    """Micro-batches (interleaved: chunk-micro-batches) whose activations stage ``pp_rank`` holds at once.

    ``schedule``: the resolved schedule's name; any other (a user schedule) is assumed to hold all m, as
    GPipe (the upper bound of a schedule that runs every forward before the backwards; `schedule_assumption`).
    """
    return INFLIGHT.get(schedule, INFLIGHT["gpipe"])(pp, vpp, m, pp_rank)


MOE_ASSUMPTION = ("MoE: activations and all-to-all traffic assume uniform routing (each rank's experts receive the "
                  "average T·k rows; a more popular expert's rank holds more); with a capacity factor, the capacity bound")
"""The plan's note on an MoE model (``model.num_moe_experts``): what its formulas assume (`mptrain.planner.moe`)."""


OFFLOAD_ASSUMPTION = ("optim.optimizer_cpu_offload: step s leaves out the optimizer step in host memory and the "
                      "shards' host-device copies (host memory bandwidth; docs/CONFIG.md \"CPU offload\"); such a "
                      "layout ranks after those that fit without offload")
"""The plan's note on an offloaded layout: what its step time leaves out."""


def planner_assumptions(cfg, layout: PlanLayout) -> list[str]:
    """The assumptions behind this layout's numbers (user optimizer / schedule, an MoE model, CPU offload), for the
    plan output."""
    moe = MOE_ASSUMPTION if getattr(cfg.model, "num_moe_experts", None) is not None else None
    offload = OFFLOAD_ASSUMPTION if layout.fully_sharded and layout.cpu_offload else None
    notes = [optimizer_states_per_element(cfg)[1], schedule_assumption(layout.schedule), moe, offload]
    return [n for n in notes if n is not None]


def layer_activation_bytes(cfg, layout: PlanLayout, *, recompute: Optional[str] = None,
                           dropout_mask_bytes: int = CUDA_DROPOUT_MASK_BYTES,
                           layers: Optional[Sequence[int]] = None) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch (no full recompute), module docstring.

    Args:
        dropout_mask_bytes: bytes per dropout-mask element (1 on CUDA; the activation size on CPU).
        layers: the global indices of the layers averaged over (a pipeline stage's; default: the whole
            model); under precision=fp8 their FP8 share weights in the FP8 savings, and their MoE share weights
            the MoE layer's bytes (`mptrain.planner.moe`) against the dense layer's.
    """
    m = cfg.model
    layers = range(m.num_layers) if layers is None else layers
    kw = dict(recompute=recompute, dropout_mask_bytes=dropout_mask_bytes, layers=layers)
    share = moe_layer_share(m, layers)
    dense = _one_layer_bytes(cfg, layout, moe=False, **kw) if share < 1 else 0.0
    moe = _one_layer_bytes(cfg, layout, moe=True, **kw) if share > 0 else 0.0
    return (1 - share) * dense + share * moe


def _one_layer_bytes(cfg, layout: PlanLayout, *, recompute: Optional[str], dropout_mask_bytes: int,
                     layers: Sequence[int], moe: bool) -> float:
    """`layer_activation_bytes` of a dense layer, or with ``moe`` of an MoE layer (the MLP's fc1 input and split
    term replaced by `moe_mlp_activation_bytes`; its experts never compute in FP8)."""
    m = cfg.model
    recompute = layout.recompute if recompute is None else recompute
    # context parallelism: every per-token activation holds s/cp tokens (the ring keeps no s × s term either)
    s, b, h, a, t = m.seq_length // layout.cp, cfg.train.micro_batch_size, m.hidden_size, m.num_attention_heads, layout.tp
    sbh = s * b * h
    scale = PARAM_BYTES[cfg.precision.name] / 2  # constants are in 16-bit bytes
    ffn_per_h = (m.ffn_hidden_size or 4 * h) / h  # f/h
    attention = MEASURED["split_selective_attention_16bit" if recompute == "selective" else "split_attention_16bit"]
    mlp_split = 0.0 if moe else MEASURED["split_mlp_per_ffn_16bit"][m.activation] * ffn_per_h
    split = (attention + mlp_split) * scale
    norms = MEASURED["norm_inputs_16bit"] * scale
    # an MoE layer's router saves the norm output the dense fc1 would: counted in its MoE bytes
    linear_inputs = (MEASURED["linear_inputs_16bit"] - (MOE_MEASURED["mlp_input_16bit"] if moe else 0.0)) * scale
    fraction = _fp8_layer_fraction(cfg, layers)
    for name in fp8_linears(cfg, t) if fraction else ():  # their 1-byte casts (module docstring)
        if moe and name in ("fc1", "fc2"):
            continue
        d_inputs, d_split = FP8_TENSORWISE_16BIT_DELTA[name]
        linear_inputs += fraction * d_inputs
        split += fraction * d_split * (ffn_per_h if name == "fc2" else 1.0)
    masks = MEASURED["hidden_dropout_masks"] * dropout_mask_bytes if m.hidden_dropout > 0 else 0.0
    lse = 4 * a * s * b / t if recompute != "selective" else 0.0  # SDPA's fp32 logsumexp [b, a/t, s]
    experts = 0.0
    if moe:
        experts = moe_mlp_activation_bytes(cfg, tp=t, ep=layout.ep, sequence_parallel=layout.sequence_parallel,
                                           act_bytes=PARAM_BYTES[cfg.precision.name],
                                           split_mlp_per_ffn_16bit=MEASURED["split_mlp_per_ffn_16bit"])
    if layout.sequence_parallel:
        return sbh * ((norms + split + masks) / t + linear_inputs) + lse + experts
    return sbh * (norms + linear_inputs + masks + split / t) + lse + experts


LINEAR_NAMES = ("qkv", "proj", "fc1", "fc2")  # the order of `layer_linear_shapes`


def fp8_linears(cfg, tp: int) -> dict:
    """The block linears (`LINEAR_NAMES`) that compute in FP8 at tensor-parallel size ``tp``, each with its weight's
    shape on one TP rank: all four under precision=fp8 unless the trainer's size rule (`gemm_runs_in_fp8`, on the
    global shape and the TP shard) keeps one bf16; none otherwise."""
    recipe = fp8_recipe_from(cfg.precision)
    if recipe is None:
        return {}
    shards = {}
    for name, ((out, inp), split) in zip(LINEAR_NAMES, layer_linear_shapes(cfg.model)):
        local = (out // tp, inp) if split == 0 else (out, inp // tp)
        if gemm_runs_in_fp8(recipe, global_shape=(out, inp), local_shape=local):
            shards[name] = local
    return shards


def fp8_weight_cast_bytes(cfg, layout: PlanLayout, rp: RankParams) -> float:
    """Bytes of the rank's cached FP8 weight casts (precision=fp8, tensorwise; 0 otherwise): 2 per weight element
    (data and its transpose; 1 under ``fp8_emulate``: data only) of each block linear in FP8 (`fp8_linears`),
    in the FP8 layers the rank holds. 0 under ZeRO-2 / ZeRO-3: no cast is cached (each GEMM casts the weight FSDP
    gathered, `mptrain.layers.fp8.apply_fp8`'s ``cache_weight_casts``; its transient 1-byte copy is ignored)."""
    p = cfg.precision
    if p.name != "fp8" or p.fp8_recipe != "tensorwise" or layout.fully_sharded:
        return 0.0
    per_layer = sum(out * inp for out, inp in fp8_linears(cfg, layout.tp).values())
    recipe, num_layers = fp8_recipe_from(p), cfg.model.num_layers
    fp8_layers = sum(recipe.layer_in_fp8(i, num_layers) for i in rp.layers)
    return fp8_layers * per_layer * (1 if p.fp8_emulate else 2)


def _fp8_layer_fraction(cfg, layers: Optional[Sequence[int]] = None) -> float:
    """The share of ``layers`` (global indices; default: all of the model's) whose linears save FP8 casts:
    precision=fp8 with the tensorwise recipe, outside the first / last ``fp8_first_last_layers_bf16``
    layers; 0 otherwise."""
    p = cfg.precision
    if p.name != "fp8" or p.fp8_recipe != "tensorwise":
        return 0.0
    recipe, num_layers = fp8_recipe_from(p), cfg.model.num_layers
    layers = range(num_layers) if layers is None else layers
    return sum(recipe.layer_in_fp8(i, num_layers) for i in layers) / max(1, len(layers))


def stage_activation_bytes(cfg, layout: PlanLayout, rp: RankParams, *, pp_rank: int) -> float:
    """Activations stage ``pp_rank`` holds at its peak: in-flight micro-batches × its layers (+ recompute)."""
    m = cfg.model
    v = layout.vpp or 1
    n_layers = len(rp.layers)
    inflight = inflight_microbatches(layout.schedule, pp=layout.pp, vpp=layout.vpp, m=layout.num_microbatches,
                                     pp_rank=pp_rank)
    layers_per_unit = n_layers / v  # one in-flight unit = one micro-batch through one chunk
    if layout.recompute != "full":
        # the stage's own FP8 share: the first stage, which holds the most micro-batches, may be all bf16 layers
        return inflight * layers_per_unit * layer_activation_bytes(cfg, layout, layers=rp.layers)
    group = max(1, m.recompute_num_layers or 1)
    sbh = m.seq_length // layout.cp * cfg.train.micro_batch_size * m.hidden_size
    checkpoint_input = PARAM_BYTES[cfg.precision.name] * sbh / (layout.tp if layout.sequence_parallel else 1)
    saved = inflight * (layers_per_unit / group) * checkpoint_input
    # one group's full activations while it is recomputed: the group with the fewest FP8 layers (uniform groups)
    layers = sorted(rp.layers)
    worst = min((layers[i:i + group] for i in range(0, len(layers), group)), default=layers,
                key=lambda g: _fp8_layer_fraction(cfg, g))
    recomputing = min(group, layers_per_unit) * layer_activation_bytes(cfg, layout, recompute="none", layers=worst)
    return saved + recomputing


def logits_bytes(cfg, layout: PlanLayout, *, vocab_size: int, inflight_last: int) -> float:
    """Last stage: saved fp32 softmax per in-flight micro-batch + the cross-entropy transient + final norm."""
    m = cfg.model
    s, b = m.seq_length // layout.cp, cfg.train.micro_batch_size
    v_pad = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, layout.tp)
    sbv = s * b * v_pad / layout.tp
    act = PARAM_BYTES[cfg.precision.name]
    return inflight_last * 4 * sbv + (act + 4) * sbv + 2 * act * s * b * m.hidden_size


def optimizer_workspace_bytes(cfg, layout: PlanLayout, rp: RankParams) -> float:
    """Distributed optimizer step: one bucket-sized fp32 scratch + this rank's shard of it (distrib_optimizer.py)."""
    if layout.sharding != OPTIM:  # DDP / FSDP step their params in place
        return 0.0  # fused Adam on CUDA allocates no temporaries; MixedPrecision's .float() aliases fp32 grads
    dp = layout.dp * layout.cp  # the grad buffers reduce (and ZeRO-1 shards) over dp × cp
    bucket = cfg.parallel.bucket_size or max(40_000_000, 1_000_000 * dp)
    elements = min(bucket, rp.numel)
    return 4 * elements * (1 + 1 / dp)


def stage_memory(cfg, layout: PlanLayout, rp: RankParams, *, pp_rank: int, vocab_size: int) -> MemoryParts:
    """All memory parts of pipeline rank ``pp_rank`` (tp_rank 0) for one layout."""
    states = model_state_bytes(cfg, layout, rp)
    logits = 0.0
    if rp.has_output:
        inflight = inflight_microbatches(layout.schedule, pp=layout.pp, vpp=layout.vpp, m=layout.num_microbatches,
                                         pp_rank=pp_rank)
        inflight_last = inflight if layout.schedule != "interleaved_1f1b" else -(-inflight // (layout.vpp or 1))
        logits = logits_bytes(cfg, layout, vocab_size=vocab_size, inflight_last=max(1, inflight_last))
    offloaded = states["weights"] + states["grads"] + states["optimizer_state"] \
        if layout.fully_sharded and layout.cpu_offload else 0.0
    return MemoryParts(
        activations=stage_activation_bytes(cfg, layout, rp, pp_rank=pp_rank),
        logits=logits,
        optimizer_workspace=optimizer_workspace_bytes(cfg, layout, rp),
        gathered=gathered_bytes(cfg, layout, rp, vocab_size=vocab_size),
        offloaded=offloaded,
        **states,
    )
