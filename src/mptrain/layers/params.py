"""Model arithmetic of a GPT config, by formula (no model built): parameters, FLOPs, peak rates.

The one home of these numbers: the trainer's metrics (`mptrain.training.throughput`), the layout
planner (`mptrain.planner`) and the benchmark harness (``bench/configs.py``) all call the
functions below. Inputs are a `ModelConfig` (or any object with its fields: ``num_layers``,
``hidden_size``, ``num_attention_heads``, ``num_query_groups``, ``kv_channels``,
``ffn_hidden_size``, ``activation``, ``add_bias_linear``, ``normalization``, ...).

Legend: L layers, h hidden, np query heads, ng query groups (K/V heads; ng = np without GQA),
hn head dim (``kv_channels``, default h/np), f ``ffn_hidden_size`` (default 4h), k = 2 for SwiGLU
(gate and up projection in one fc1) else 1, s sequence length, V / V_pad the unpadded / padded
vocabulary, T tokens per iteration.

Parameters of one layer (Megatron ``ColumnParallelLinear`` / ``RowParallelLinear``, Shoeybi et
al. 2019 §3; megatron/core/transformer/attention.py and mlp.py):
    QKV weight h·(np + 2·ng)·hn, bias (np + 2·ng)·hn          (column-parallel)
    proj weight np·hn·h, bias h (replicated over TP)           (row-parallel)
    fc1 weight h·k·f, bias k·f                                 (column-parallel)
    fc2 weight f·h, bias h (replicated over TP)                (row-parallel)
    two norms, replicated: 2h each (LayerNorm) or h (RMSNorm)
    with ``qk_layernorm`` two norms over hn, replicated: 2hn each (LayerNorm) or hn (RMSNorm)

Mixture-of-Experts layers (the layers ``moe_layer_freq`` marks when ``num_moe_experts`` is set;
`mptrain.layers.moe`) replace fc1 / fc2 by, with E experts, top-k, f_e the expert width
(``moe_ffn_hidden_size``), f_s the shared expert's width:
    router weight E·h                                          (replicated over TP)
    experts E·(h·k'·f_e + f_e·h), k' = 2 for SwiGLU else 1     (split over ETP = TP)
    shared expert h·k'·f_s + f_s·h (split over TP), its gate h  (replicated)
A token multiplies the router, k of the E experts and the shared expert: the *active* weights
(`layer_matmul_weights`, `active_parameters`); every expert is a parameter (`layer_params`,
`count_parameters`). MoE layers have no linear biases (`mptrain.layers.moe.config`).

Two whole-model conventions (`count_parameters`):

``"real"``: what `build_model_chunks` creates, summed over all ranks, vocab padding excluded and
the tied embedding counted once (the last stage's copy is a replica) — equals Σ numel of the
params whose `ShardSpec.counts_on` holds, over every rank of one DP replica, minus padded rows.

``"design_doc"``: the design document's worked example (`seed_2.8b`: 12 layers, h 4096, 8 heads,
V 50257 → 2,827,821,056): per layer QKV 3h² + projection h² + MLP 8h² + two LayerNorms 2·2h
= 12h² + 4h; untied input and output embeddings 2·V·h; no linear biases, no position
embedding, no final norm, unpadded vocab. Attention / MLP widths follow the config (GQA,
kv_channels, ffn_hidden_size, SwiGLU), so for the example's shape it is exactly the formula.

FLOPs per iteration (`flops_per_iteration`; DESIGN.md §2):

    F = 6·N_mm·T + 12·L·a·s·T

N_mm = L·(h·(np + 2·ng)·hn + np·hn·h + h·k·f + f·h) + V_pad·h, the matmul weights of the model as
configured (an MoE layer's active ones: router, k experts, shared expert, in place of fc1 and fc2; as
Megatron's ``moe_layer_flops`` plus the router's E·h) (the output layer counted once whether tied or not: the input embedding is a lookup),
and a = np·hn the attention width (= h unless ``kv_channels`` says otherwise). A multiply-add is
2 FLOPs, so the forward pass costs 2·N_mm per token in the linears plus 4·a·s per layer and token
in attention (QKᵀ and P·V, each 2·a·s; counted in full, no causal halving); the backward pass
costs twice the forward (input grad and weight grad). Without GQA, SwiGLU or a custom f this is
Megatron's ``num_floating_point_operations`` for GPT (72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)),
Narayanan et al. 2021 §5.1 without recomputation). Recomputation is not model FLOPs; the
planner's step-time estimate adds it (``recompute``): ``full`` one more forward of the
transformer layers (the output layer is not recomputed: Narayanan et al.'s 96·B·s·L·h²·(1 +
s/(6h) + V/(16·L·h))), ``selective`` one more forward of the attention core (4·L·a·s·T).

Peak rates: `DENSE_BF16_PEAK_TFLOPS` (by GPU name) and `DEFAULT_PEAK_TFLOPS`, the dense bf16 rate
MFU divides by for every precision (tokens/s is the figure that compares precisions).
"""

from __future__ import annotations

from typing import Optional

from mptrain.errors import ConfigError
from mptrain.layers.embedding import padded_vocab_size
from mptrain.layers.moe.config import is_moe_layer, moe_ffn_hidden_size

CONVENTIONS = ("real", "design_doc")
RECOMPUTE = (None, "none", "selective", "full")
"""``recompute`` values of `flops_per_token` / `flops_per_iteration` (None and "none" mean no recompute)."""

DENSE_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
"""Dense bf16 tensor-core peak per GPU in TFLOP/s (SXM parts, no sparsity), keyed by a substring of
the device name (``torch.cuda.get_device_name``); first match in insertion order wins."""
DEFAULT_PEAK_TFLOPS = DENSE_BF16_PEAK_TFLOPS["H100"]
"""The peak assumed where no device is at hand (the planner's and the benchmark's H100 / H200 SXM)."""


def peak_tflops_for_device(device_name: str) -> Optional[float]:
    """Dense bf16 peak (TFLOP/s) of the GPU called ``device_name``; None when it is not in the table."""
    for key, peak in DENSE_BF16_PEAK_TFLOPS.items():
        if key in device_name:
            return peak
    return None


def _widths(m) -> tuple:
    """(h, np, ng, hn, f, k) of model config ``m`` with the defaults filled in (module legend)."""
    h, np_ = m.hidden_size, m.num_attention_heads
    ng = m.num_query_groups or np_
    hn = m.kv_channels or h // np_
    f = m.ffn_hidden_size or 4 * h
    k = 2 if m.activation == "swiglu" else 1
    return h, np_, ng, hn, f, k


def layer_linear_shapes(m) -> list:
    """The global weight shapes ``[out, in]`` of one layer's four linears (QKV, proj, fc1, fc2), each with the
    dim TP splits: 0 (``out``: the column-parallel QKV and fc1) or 1 (``in``: the row-parallel proj and fc2)."""
    h, np_, ng, hn, f, k = _widths(m)
    return [(((np_ + 2 * ng) * hn, h), 0), ((h, np_ * hn), 1), ((k * f, h), 0), ((h, f), 1)]


def _is_moe_layer(m, layer_number: Optional[int]) -> bool:
    # a config object of another kind (bench, planner) may predate the MoE keys: dense
    if layer_number is None or getattr(m, "num_moe_experts", None) is None:
        return False
    return is_moe_layer(m, layer_number)


def _moe_widths(m) -> tuple:
    """(E, top-k, f_e, f_s) of an MoE config (f_s = 0 without a shared expert)."""
    return (m.num_moe_experts, m.moe_router_topk, moe_ffn_hidden_size(m), m.moe_shared_expert_intermediate_size or 0)


def moe_mlp_weights(m, *, active: bool) -> tuple:
    """(replicated: router and shared-expert gate, experts: split over ETP, shared expert: split over TP) weights of
    one MoE layer (module docstring): all E experts, or with ``active`` the k a token uses."""
    h, k2 = m.hidden_size, 2 if m.activation == "swiglu" else 1
    e, k, f_e, f_s = _moe_widths(m)
    experts = (k if active else e) * (h * k2 * f_e + f_e * h)
    gate = h if f_s and m.moe_shared_expert_gate else 0
    return e * h + gate, experts, h * k2 * f_s + f_s * h


def layer_matmul_weights(m, layer_number: Optional[int] = None) -> int:
    """Weights of one transformer layer's four linears (QKV, proj, fc1, fc2), whole (not per TP rank); for an
    MoE layer (global index ``layer_number``) QKV, proj and the active MoE weights (`moe_mlp_weights`)."""
    shapes = layer_linear_shapes(m)
    if not _is_moe_layer(m, layer_number):
        return sum(out * inp for (out, inp), _ in shapes)
    return sum(out * inp for (out, inp), _ in shapes[:2]) + sum(moe_mlp_weights(m, active=True))


def model_matmul_weights(m) -> int:
    """Σ over the layers of `layer_matmul_weights` (dense and MoE layers alike)."""
    return sum(layer_matmul_weights(m, n) for n in range(m.num_layers))


def norm_params(m, width: Optional[int] = None) -> int:
    """Parameters of one norm over h (or ``width``): 2h (LayerNorm: weight and bias) or h (RMSNorm)."""
    width = width or m.hidden_size
    return 2 * width if m.normalization == "LayerNorm" else width


def _layer_norms(m) -> int:
    """The norms of one layer: before attention and before the MLP, and with ``qk_layernorm`` the query and key
    norms over hn."""
    hn = m.kv_channels or m.hidden_size // m.num_attention_heads
    return 2 * norm_params(m) + (2 * norm_params(m, hn) if getattr(m, "qk_layernorm", False) else 0)


def layer_params(m, *, tp: int = 1, layer_number: Optional[int] = None, etp: Optional[int] = None) -> int:
    """Elements of one transformer layer on one TP rank of ``tp`` (module docstring's table).

    Column-parallel weights and biases are split over TP; the row-parallel biases and the norms
    are replicated. At ``tp=1`` this is the layer's whole parameter count. ``layer_number`` (global,
    0-based): an MoE layer counts its router, all its experts (split over ``etp``, None = tp) and its shared
    expert instead of fc1 / fc2.
    """
    h, np_, ng, hn, f, k = _widths(m)
    qkv_bias = (np_ + 2 * ng) * hn // tp if not m.add_bias_linear and getattr(m, "add_qkv_bias", False) else 0
    if _is_moe_layer(m, layer_number):  # MoE layers have no other linear biases (mptrain.layers.moe.config)
        attention = sum(out * inp for (out, inp), _ in layer_linear_shapes(m)[:2]) // tp + qkv_bias
        replicated, experts, shared = moe_mlp_weights(m, active=False)
        return attention + replicated + experts // (etp or tp) + shared // tp + _layer_norms(m)
    weights = layer_matmul_weights(m) // tp
    biases = ((np_ + 2 * ng) * hn + k * f) // tp + 2 * h if m.add_bias_linear else qkv_bias  # QKV only: Qwen2
    return weights + biases + _layer_norms(m)


def count_parameters(model_cfg, *, vocab_size: int, convention: str = "real", tp: int = 1,
                     include_padding: bool = False) -> int:
    """Number of parameters of ``model_cfg`` with an unpadded vocabulary of ``vocab_size``.

    Args:
        convention: ``"real"`` or ``"design_doc"`` (module docstring).
        tp: tensor-parallel size; only matters with ``include_padding`` (V padded to
            make_vocab_size_divisible_by × tp) — the real count is otherwise layout-independent.
        include_padding: count the padded vocabulary rows ("real" only).
    Raises:
        ConfigError: unknown convention.
    """
    if convention not in CONVENTIONS:
        raise ConfigError(f"count_parameters: convention={convention!r} is not one of {list(CONVENTIONS)}")
    h, L = model_cfg.hidden_size, model_cfg.num_layers
    if convention == "design_doc":
        return L * (layer_matmul_weights(model_cfg) + 2 * 2 * h) + 2 * vocab_size * h
    v = padded_vocab_size(vocab_size, model_cfg.make_vocab_size_divisible_by, tp) if include_padding else vocab_size
    layers = sum(layer_params(model_cfg, layer_number=n) for n in range(L))
    total = layers + norm_params(model_cfg) + v * h  # layers, final norm, word embedding
    if model_cfg.position_embedding_type == "learned_absolute":
        total += (model_cfg.max_position_embeddings or model_cfg.seq_length) * h
    if model_cfg.untie_embeddings_and_output_weights:
        total += v * h
    return total


def active_parameters(model_cfg, *, vocab_size: int) -> int:
    """`count_parameters` (``"real"``) less the experts a token does not use: E − k of each MoE layer's
    experts (the parameters of one token's forward; equal to the total for a dense model)."""
    total = count_parameters(model_cfg, vocab_size=vocab_size)
    unused = sum(moe_mlp_weights(model_cfg, active=False)[1] - moe_mlp_weights(model_cfg, active=True)[1]
                 for n in range(model_cfg.num_layers) if _is_moe_layer(model_cfg, n))
    return total - unused


def matmul_weights(m, *, padded_vocab_size: int) -> int:
    """N_mm = L·(QKV + proj + fc1 + fc2 weights) + V_pad·h: the weights every token multiplies (MoE layers:
    their active weights, `layer_matmul_weights`)."""
    return model_matmul_weights(m) + padded_vocab_size * m.hidden_size


def flops_per_token(m, *, padded_vocab_size: int, recompute: Optional[str] = None) -> int:
    """FLOPs of one token in one training iteration (forward + backward; module docstring).

    Args:
        m: ModelConfig (its ``seq_length`` is s). padded_vocab_size: V_pad of the layout.
        recompute: None / "none" (model FLOPs, what MFU counts), "selective" or "full" (adds the
            recomputed forward work).
    Raises:
        ValueError: unknown ``recompute``.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"flops_per_token: recompute={recompute!r} is not one of {list(RECOMPUTE)}")
    L, s = m.num_layers, m.seq_length
    _, np_, _, hn, _, _ = _widths(m)
    attention_fwd = 4 * L * np_ * hn * s  # QKᵀ and P·V of every layer, 2·a·s each
    forward = 2 * matmul_weights(m, padded_vocab_size=padded_vocab_size) + attention_fwd
    flops = 3 * forward  # backward = 2 × forward
    if recompute == "full":
        flops += 2 * model_matmul_weights(m) + attention_fwd
    elif recompute == "selective":
        flops += attention_fwd
    return flops


def flops_per_iteration(m, *, padded_vocab_size: int, tokens_per_iteration: int,
                        recompute: Optional[str] = None) -> int:
    """F = 6·N_mm·T + 12·L·a·s·T (+ recomputation; module docstring), an exact integer.

    Args:
        tokens_per_iteration: T = global_batch_size × seq_length.
        (the rest: `flops_per_token`)
    Raises:
        ValueError: unknown ``recompute``.
    """
    return flops_per_token(m, padded_vocab_size=padded_vocab_size, recompute=recompute) * tokens_per_iteration
