"""Schema of the `model` config group (Megatron key names; DESIGN.md §1) and its layer spec tree.

The model is a component (`_target_`: the model provider, one pipeline chunk per call) and its
transformer layer is a tree of component nodes, Megatron-core's ``ModuleSpec`` written as config
(docs/COMPONENTS.md "Layer spec tree"). Every node is ``{_target_, _partial_: true[, submodules]}``;
`mptrain.layers.spec.build_module` builds it with `mptrain.components.build` and calls it with the
runtime keywords (config, the chunk's `mptrain.layers.context.LayerContext` as ``context``, sizes,
rng_tracker, ...). A user's class is one override away::

    model.transformer_layer.submodules.self_attention.submodules.core_attention._target_=my_pkg.MyCore

Keys a node carries besides ``_target_`` / ``_partial_`` / ``submodules`` (added with ``+``) are its
target's own keywords, checked against the target's signature at start-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


def _node(target: str):
    return dataclasses.field(default_factory=lambda: SpecNode(_target_=target))


@dataclasses.dataclass
class SpecNode:
    """A leaf of the layer spec tree: a class (or factory) the runtime calls with its keywords."""

    _target_: str = "???"
    """Dotted path of the class (e.g. mptrain.layers.linear.ColumnParallelLinear)."""
    _partial_: bool = True
    """Always true: the runtime supplies sizes, groups, init and dtype when it builds the layer."""


@dataclasses.dataclass
class SelfAttentionSubmodules:
    """Megatron's ``SelfAttentionSubmodules``."""

    linear_qkv: SpecNode = _node("mptrain.layers.linear.ColumnParallelLinear")
    """Fused Q/K/V projection h -> (np + 2 ng)·hn, column-parallel (interface: ColumnParallelLinear)."""
    core_attention: SpecNode = _node("mptrain.layers.attention.DotProductAttention")
    """softmax(Q Kᵀ/√hn + mask)·V on this rank's heads (interface: mptrain.layers.attention.CoreAttention);
    the default reads model.attention_backend."""
    linear_proj: SpecNode = _node("mptrain.layers.linear.RowParallelLinear")
    """Output projection np·hn -> h, row-parallel (interface: RowParallelLinear)."""
    q_layernorm: SpecNode = _node("mptrain.layers.norms.Norm")
    """With model.qk_layernorm: the norm over hn of each query head (interface: mptrain.layers.norms.NormModule)."""
    k_layernorm: SpecNode = _node("mptrain.layers.norms.Norm")
    """With model.qk_layernorm: the norm over hn of each key head (interface: mptrain.layers.norms.NormModule)."""


@dataclasses.dataclass
class SelfAttentionSpec:
    _target_: str = "mptrain.layers.attention.SelfAttention"
    _partial_: bool = True
    submodules: SelfAttentionSubmodules = dataclasses.field(default_factory=SelfAttentionSubmodules)


@dataclasses.dataclass
class MLPSubmodules:
    """Megatron's ``MLPSubmodules`` plus the activation (Megatron: ``config.activation_func``)."""

    linear_fc1: SpecNode = _node("mptrain.layers.linear.ColumnParallelLinear")
    """h -> parts·f, column-parallel (parts = the activation's fc1_parts: 2 for swiglu's [gate; up])."""
    activation: SpecNode = _node("mptrain.layers.mlp.Activation")
    """[.., parts·f/tp] -> [.., f/tp] (interface: mptrain.layers.mlp.ActivationFunction); the default reads
    model.activation."""
    linear_fc2: SpecNode = _node("mptrain.layers.linear.RowParallelLinear")
    """f -> h, row-parallel (interface: RowParallelLinear)."""


@dataclasses.dataclass
class MLPSpec:
    _target_: str = "mptrain.layers.mlp.MLP"
    _partial_: bool = True
    submodules: MLPSubmodules = dataclasses.field(default_factory=MLPSubmodules)


@dataclasses.dataclass
class SharedExpertSpec:
    _target_: str = "mptrain.layers.moe.shared_experts.SharedExpertMLP"
    _partial_: bool = True
    submodules: MLPSubmodules = dataclasses.field(default_factory=MLPSubmodules)


@dataclasses.dataclass
class MoESubmodules:
    """Megatron's ``MoESubmodules`` (megatron/core/transformer/moe/moe_layer.py) plus the router."""

    router: SpecNode = _node("mptrain.layers.moe.router.TopKRouter")
    """Gate h -> E logits and top-k selection (interface: mptrain.layers.moe.router.TopKRouter): returns
    ``(probs [T, E], routing_map [T, E] bool)``; reads the model.moe_router_* keys. A router with ``route`` (the
    top-k form, mptrain.layers.moe.router.RoutesTopK) feeds a dropless ep = etp = 1 dispatch from it."""
    experts: SpecNode = _node("mptrain.layers.moe.experts.GroupedMLP")
    """The local experts' fc1 -> activation (× routing prob) -> fc2 over tokens grouped expert-major
    (interface: mptrain.layers.moe.experts.GroupedMLP); the default reads model.activation and
    model.moe_grouped_gemm."""
    shared_experts: SharedExpertSpec = dataclasses.field(default_factory=SharedExpertSpec)
    """The shared expert (Megatron's ``SharedExpertMLP``; interface: mptrain.layers.mlp.MLP), built only with
    model.moe_shared_expert_intermediate_size: a dense MLP of that width on every token."""


@dataclasses.dataclass
class MoESpec:
    _target_: str = "mptrain.layers.moe.layer.MoELayer"
    _partial_: bool = True
    submodules: MoESubmodules = dataclasses.field(default_factory=MoESubmodules)


@dataclasses.dataclass
class TransformerLayerSubmodules:
    """Megatron's ``TransformerLayerSubmodules`` (pre-LN GPT: norm -> attention, norm -> MLP)."""

    input_layernorm: SpecNode = _node("mptrain.layers.norms.Norm")
    """Norm before attention (interface: mptrain.layers.norms.NormModule); the default reads
    model.normalization. Also builds the final norm (decoder.final_layernorm) on the last stage."""
    self_attention: SelfAttentionSpec = dataclasses.field(default_factory=SelfAttentionSpec)
    pre_mlp_layernorm: SpecNode = _node("mptrain.layers.norms.Norm")
    """Norm before the MLP (same interface and default as input_layernorm)."""
    mlp: MLPSpec = dataclasses.field(default_factory=MLPSpec)
    moe: MoESpec = dataclasses.field(default_factory=MoESpec)
    """The Mixture-of-Experts layer in place of ``mlp`` on the layers model.moe_layer_freq marks (with
    model.num_moe_experts set); its parameters are named ``decoder.layers.<n>.mlp.*`` like the MLP's."""


@dataclasses.dataclass
class TransformerLayerSpec:
    _target_: str = "mptrain.layers.transformer.TransformerLayer"
    _partial_: bool = True
    submodules: TransformerLayerSubmodules = dataclasses.field(default_factory=TransformerLayerSubmodules)


def recompute_granularity(model) -> Optional[str]:
    """The recompute granularity that runs: ``selective`` when ``model.recompute_activations`` is set (Megatron's
    ``--recompute-activations`` sets ``recompute_granularity = 'selective'``), else ``model.recompute_granularity``."""
    return "selective" if getattr(model, "recompute_activations", False) else model.recompute_granularity


@dataclasses.dataclass
class ModelConfig:
    """A GPT model. Sizes are counts (layers, heads) or elements (hidden sizes)."""

    _target_: str = "mptrain.layers.gpt.GPTModel"
    """The model provider: called once per pipeline chunk (Megatron's ``model_provider(pre_process,
    post_process)``) with the runtime keywords of `mptrain.layers.gpt.GPTModel` (config, groups, parallel,
    pre_process, post_process, layer_numbers, vp_stage, vocab_size, params_dtype, device, seed,
    rng_tracker). Interface: `mptrain.layers.gpt.ModelChunk`."""
    _partial_: bool = True

    name: str = "tiny"
    """Preset name, used in the default run.dir."""
    num_layers: int = 4
    """Transformer layers in the whole model (split over pp × vpp stages)."""
    hidden_size: int = 64
    """Model width h."""
    num_attention_heads: int = 4
    """Query heads; must be divisible by tensor_model_parallel_size."""
    num_query_groups: Optional[int] = None
    """K/V heads for grouped-query attention; null = num_attention_heads (multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; null = 4 × hidden_size."""
    kv_channels: Optional[int] = None
    """Head dim; null = hidden_size / num_attention_heads."""
    seq_length: int = 64
    """Tokens per sample s."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position embedding; null = seq_length."""
    vocab_size: Optional[int] = None
    """Unpadded vocabulary; null = take the tokenizer's size."""
    make_vocab_size_divisible_by: int = 128
    """The vocab is padded to a multiple of this × tensor_model_parallel_size."""
    untie_embeddings_and_output_weights: bool = False
    """false: the output layer reuses the word embedding (synced between first and last stage)."""
    hidden_dropout: float = 0.0
    """Dropout after attention / MLP projections and on embeddings."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal init; output projections use std / sqrt(2 × num_layers)."""
    normalization: str = "LayerNorm"
    """LayerNorm | RMSNorm: read by the default norm nodes (`mptrain.layers.norms.Norm`) of transformer_layer."""
    layernorm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    """Megatron's --apply-layernorm-1p (zero-centred gamma): each norm stores w = gamma - 1, initialised to
    zeros, and applies (1 + w) (`mptrain.layers.norms.LayerNorm1P` / `RMSNorm1P`, as Transformer Engine's
    zero_centered_gamma): the same math at init, weight decay pulls gamma towards 1 rather than 0.
    normalization=LayerNorm or RMSNorm; Hugging Face export refuses it."""
    activation: str = "gelu"
    """gelu | swiglu: read by the default activation node (`mptrain.layers.mlp.Activation`)."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute | rope."""
    rotary_base: int = 10000
    """RoPE base θ (frequencies θ^(-2i/hn)); Hugging Face's ``rope_theta``."""
    rotary_percent: float = 1.0
    """Megatron's --rotary-percent, in (0, 1]: RoPE rotates the first int(rotary_percent × head dim) dims of each
    head (frequencies over that width, θ^(-2i/rot)) and passes the rest through unchanged; 1 = the whole head.
    position_embedding_type=rope only; the rotated width must be even; Hugging Face export refuses < 1."""
    rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (Megatron's ``--use-rope-scaling``; Hugging Face ``rope_type: llama3``):
    wavelengths above original_max_position_embeddings / low_freq_factor are divided by rope_scaling_factor,
    those below original / high_freq_factor kept, those between interpolated."""
    rope_scaling_factor: float = 8.0
    """With rope_scaling: the factor long wavelengths are stretched by (Llama 3.1: 8, Llama 3.2: 32)."""
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    """With rope_scaling: the context length the model was pretrained at before the extension."""
    add_bias_linear: bool = True
    """Biases in the QKV / projection / MLP linears."""
    add_qkv_bias: bool = False
    """Biases in the QKV linear only, when add_bias_linear is false (Megatron's ``--add-qkv-bias``; Qwen2)."""
    qk_layernorm: bool = False
    """Megatron's --qk-layernorm: a norm (model.normalization, over the head dim hn) on each head's query and key
    after the QKV projection, before RoPE (Qwen3; Dehghani et al. 2023 §3.1): weights
    ``self_attention.q_layernorm.weight`` / ``k_layernorm.weight`` ``[hn]``, one per layer, replicated over TP."""
    attention_softmax_in_fp32: bool = True
    """Compute attention softmax in fp32 on the non-flash fp16/bf16 paths."""
    label_smoothing: float = 0.0
    recompute_granularity: Optional[str] = None
    """null | full | selective (selective recomputes the attention core only)."""
    recompute_activations: bool = False
    """Megatron's --recompute-activations: shorthand for recompute_granularity=selective (true with
    recompute_granularity=full is an error; read through `recompute_granularity`)."""
    recompute_method: Optional[str] = None
    """uniform | block (with recompute_granularity=full)."""
    recompute_num_layers: Optional[int] = None
    """uniform: layers per recompute chunk; block: layers recomputed per stage."""
    attention_backend: str = "auto"
    """auto | sdpa | unfused, read by the default core_attention node (`mptrain.layers.attention.DotProductAttention`).
    auto: `scaled_dot_product_attention`, except fp16/bf16 on CUDA with a head dim
    above 256 (no flash / cuDNN kernel; SDPA would fall back to its slow memory-efficient or fp32 math
    kernels), where the unfused path runs: Q·Kᵀ GEMM, scale + causal mask + softmax (fp32 accumulation,
    half-precision in/out, as Megatron's fused softmax), P·V GEMM."""
    compile_layers: Optional[bool] = None
    """Run the model through `torch.compile` (fuses bias-GeLU, bias-dropout-add, LayerNorm epilogues, the
    cross entropy's passes); how much of it is one graph is ``compile_scope``. TP collectives inside are
    the functional ones. null (default): on for CUDA devices, eager on CPU
    (`mptrain.layers.compile.resolve_compile_layers`); true / false force it. The first step pays the
    compile time (logged); with dropout > 0 the masks come from the compiled graph's RNG, not the eager
    ones (`mptrain.layers.random`, "Dropout in a compiled chunk")."""
    compile_scope: str = "chunk"
    """With ``compile_layers``: ``chunk`` compiles each model chunk's whole forward (embedding, layers,
    final norm, output layer, cross entropy) as one graph, so a micro-batch is one forward and one
    backward graph launch (torchtitan / a plain compiled GPT do the same); ``layer`` compiles each
    TransformerLayer separately (and the cross entropy's passes). Dropout and activation recomputation
    are inside the chunk graph; ``chunk`` would fall back to ``layer``, saying why in the log, where the
    chunk cannot be one graph (`mptrain.layers.compile.chunk_compile_blocker`; applied by
    `mptrain.layers.compile.apply_compile`)."""
    compile_mode: Optional[str] = "auto"
    """``torch.compile(mode=...)`` of the compiled regions: ``auto``, null (Inductor's default), or one of
    torch's modes (``default``, ``reduce-overhead``, ``max-autotune``, ``max-autotune-no-cudagraphs``).
    ``auto`` = ``reduce-overhead`` (CUDA graphs: each micro-batch's forward and backward replayed as
    one graph launch each) where the chunk is one graph on a CUDA GPU at tp = pp = 1 — there every
    graph's outputs are consumed before its next replay and no collective is inside the graph —
    and Inductor's default elsewhere (`mptrain.layers.compile.compile_mode_for`)."""
    # --- Mixture of Experts (Megatron-core's keys, megatron/core/transformer/transformer_config.py) ---------
    num_moe_experts: Optional[int] = None
    """E, the routed experts of an MoE layer; null = a dense model (every layer has the MLP)."""
    moe_layer_freq: Any = 1
    """Which layers are MoE (with num_moe_experts): an int N = every N-th layer, layer l (0-based) iff
    l % N == 0 (Megatron's --moe-layer-freq); or a list of 0/1, one per layer (1 = MoE)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Each routed expert's FFN width; null = ffn_hidden_size (4 × hidden_size when that is null too)."""
    moe_router_topk: int = 2
    """k: experts per token, 1 <= k <= num_moe_experts."""
    moe_router_score_function: str = "softmax"
    """softmax | sigmoid. softmax: post-softmax (softmax over the k chosen logits) unless
    moe_router_pre_softmax; sigmoid: per-expert scores, normalised over the k chosen when k > 1."""
    moe_router_pre_softmax: bool = False
    """softmax over all E logits, then top-k (weights not renormalised; Qwen's norm_topk_prob=false)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the k routing weights (null = 1)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss (Switch Transformer, per micro-batch) | seq_aux_loss (per sequence, DeepSeek-V2) | none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss of each MoE layer (0 = none); ~1 per layer at perfect balance."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss mean(logsumexp(logits)²) (ST-MoE); null = none."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): an fp32 per-expert bias added to the scores for the top-k choice
    only, moved by moe_router_bias_update_rate × sign(mean load − load) after each step; sigmoid scores only."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update per iteration."""
    moe_router_dtype: Optional[str] = None
    """null (the model's dtype) | fp32 | fp64: the dtype of the gating GEMM and the routing math."""
    moe_input_jitter_eps: Optional[float] = None
    """Multiplies the router's input by U(1 − eps, 1 + eps) in training (Switch Transformer); null = off."""
    moe_expert_capacity_factor: Optional[float] = None
    """null = dropless (every token reaches its k experts); c > 0: each expert takes at most
    ceil(T·k/E · c) of the T tokens of a rank's micro-batch, the rest of its tokens are dropped."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor: every expert computes exactly its capacity of rows (zero rows pad), static shapes."""
    moe_token_drop_policy: str = "probs"
    """With a capacity factor, which tokens an expert keeps: probs (the highest routing weights) | position
    (the earliest tokens)."""
    moe_token_dispatcher_type: str = "alltoall"
    """alltoall | allgather: how tokens reach the ranks of their experts under expert parallelism (one rank:
    permute only)."""
    moe_grouped_gemm: bool = True
    """The local experts as grouped GEMMs (``torch._grouped_mm``) where the build has them, else one GEMM per
    expert; the startup kernels: line says which ran."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared expert (a dense MLP on every token, added to the routed output); null = none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x·g), g ``[1, h]`` (Qwen2-MoE's shared_expert_gate)."""
    transformer_layer: TransformerLayerSpec = dataclasses.field(default_factory=TransformerLayerSpec)
    """The layer spec tree (a registered component: `_target_` + `_partial_` + `submodules`)."""
