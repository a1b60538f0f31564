"""Schema of the `model` config group (Megatron key names; DESIGN.md §1)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass
class ModelConfig:
    """A GPT model. Sizes are counts (layers, heads) or elements (hidden sizes)."""

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
    """LayerNorm | RMSNorm."""
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"
    """gelu | swiglu."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute | rope."""
    rotary_base: int = 10000
    add_bias_linear: bool = True
    """Biases in the QKV / projection / MLP linears."""
    attention_softmax_in_fp32: bool = True
    """Compute attention softmax in fp32 on the non-flash fp16/bf16 paths."""
    label_smoothing: float = 0.0
    recompute_granularity: Optional[str] = None
    """null | full | selective (selective recomputes the attention core only)."""
    recompute_method: Optional[str] = None
    """uniform | block (with recompute_granularity=full)."""
    recompute_num_layers: Optional[int] = None
    """uniform: layers per recompute chunk; block: layers recomputed per stage."""
    attention_backend: str = "auto"
    """auto | sdpa | unfused. auto: `scaled_dot_product_attention`, except fp16/bf16 on CUDA with a head dim
    above 256 (no flash / cuDNN kernel; SDPA would fall back to its slow memory-efficient or fp32 math
    kernels), where the unfused path runs: Q·Kᵀ GEMM, scale + causal mask + softmax (fp32 accumulation,
    half-precision in/out, as Megatron's fused softmax), P·V GEMM."""
    compile_layers: bool = False
    """Speed option: run each TransformerLayer's forward through `torch.compile` (fuses bias-GeLU,
    bias-dropout-add, LayerNorm epilogues). TP collectives stay eager (graph breaks). Off by default:
    the first steps pay the compile time, and with dropout > 0 the masks come from Inductor's RNG."""
    transformer_layer: Any = dataclasses.field(
        default_factory=lambda: {"_target_": "mptrain.layers.transformer.TransformerLayer", "_partial_": True}
    )
    """The layer implementation (a registered component: `_target_` + `_partial_`)."""
