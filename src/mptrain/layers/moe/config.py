"""The Mixture-of-Experts keys of ``model.*``: their rules (checked once, here) and what they derive.

Keys and meanings are Megatron-core's (``megatron/core/transformer/transformer_config.py``,
``__post_init__``'s MoE checks); the schema is `mptrain.config.model.ModelConfig`. `check_moe_config`
runs from `mptrain.layers.gpt.check_model_config` on every rank before any process group exists, so a
bad combination is one `ConfigError` line naming the key and the fix.

Derived here: which layers are MoE (`moe_layer_pattern`), the routed experts' FFN width
(`moe_ffn_hidden_size`) and the capacity of an expert (`expert_capacity`, Megatron's ``get_capacity``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from mptrain.errors import ConfigError, check_choice

SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""``model.moe_router_score_function``."""
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
"""``model.moe_router_load_balancing_type``: Switch aux loss per micro-batch, per sequence, or none."""
TOKEN_DROP_POLICIES = ("probs", "position")
"""``model.moe_token_drop_policy``: which tokens an expert over capacity keeps."""
DISPATCHER_TYPES = ("alltoall", "allgather")
"""``model.moe_token_dispatcher_type`` (one rank: both are a local permutation)."""
ROUTER_DTYPES = (None, "fp32", "fp64")
"""``model.moe_router_dtype``: null = the model's dtype."""


def is_moe(model) -> bool:
    """The model has MoE layers (``model.num_moe_experts`` is set)."""
    return model.num_moe_experts is not None


def moe_layer_pattern(model) -> list:
    """``[bool] * num_layers``: which layers (global, 0-based) hold the MoE layer instead of the MLP.

    ``moe_layer_freq`` N (int): layer l iff l % N == 0 (Megatron's ``--moe-layer-freq``: N = 1 every
    layer, N = 2 layers 0, 2, 4, ...); a list: its 0/1 entries. All False for a dense model.
    """
    n = model.num_layers
    if not is_moe(model):
        return [False] * n
    freq = model.moe_layer_freq
    if isinstance(freq, int):
        return [layer % freq == 0 for layer in range(n)]
    return [bool(v) for v in freq]


def is_moe_layer(model, layer_number: int) -> bool:
    """Layer ``layer_number`` (global, 0-based) is an MoE layer (`moe_layer_pattern`)."""
    return moe_layer_pattern(model)[layer_number]


def moe_ffn_hidden_size(model) -> int:
    """A routed expert's FFN width: ``moe_ffn_hidden_size``, else ``ffn_hidden_size``, else 4h."""
    return model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Rows one expert takes: ``ceil(T·k / E · capacity_factor)`` of a rank's T tokens (Megatron's
    ``get_capacity`` on ``num_tokens · topk``; moe_utils.py)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def _check_layer_freq(model) -> None:
    freq, n = model.moe_layer_freq, model.num_layers
    if isinstance(freq, (bool, str)) or not isinstance(freq, (int, Sequence)):
        raise ConfigError(f"model.moe_layer_freq={freq!r} must be an int N >= 1 (every N-th layer) or a list of 0/1 "
                          f"per layer; set e.g. model.moe_layer_freq=1")
    if isinstance(freq, int):
        if freq < 1:
            raise ConfigError(f"model.moe_layer_freq={freq} must be >= 1 (1 = every layer is MoE)")
        return
    if len(freq) != n or any(v not in (0, 1) for v in freq):
        raise ConfigError(f"model.moe_layer_freq has {len(freq)} entries {list(freq)}; it needs model.num_layers={n} "
                          "entries of 0 or 1 (1 = MoE layer)")


def _check_router(model) -> None:
    e, k = model.num_moe_experts, model.moe_router_topk
    if not isinstance(k, int) or not 1 <= k <= e:
        raise ConfigError(f"model.moe_router_topk={k} must be between 1 and model.num_moe_experts={e}")
    check_choice("model.moe_router_score_function", model.moe_router_score_function, SCORE_FUNCTIONS)
    softmax = model.moe_router_score_function == "softmax"
    if k == 1 and softmax and not model.moe_router_pre_softmax:
        # softmax over one chosen logit is 1: the router would get no gradient (Megatron refuses it too)
        raise ConfigError("model.moe_router_topk=1 with post-softmax routing gives the router no gradient; set "
                          "model.moe_router_pre_softmax=true (or moe_router_score_function=sigmoid)")
    if model.moe_router_pre_softmax and not softmax:
        raise ConfigError("model.moe_router_pre_softmax=true applies to moe_router_score_function=softmax; set "
                          "model.moe_router_pre_softmax=false")
    factor = model.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        raise ConfigError(f"model.moe_router_topk_scaling_factor={factor} must be > 0 or null")
    check_choice("model.moe_router_dtype", model.moe_router_dtype, ROUTER_DTYPES)
    eps = model.moe_input_jitter_eps
    if eps is not None and not 0.0 < eps < 1.0:
        raise ConfigError(f"model.moe_input_jitter_eps={eps} must be in (0, 1) or null (no jitter)")
    if model.moe_router_enable_expert_bias and softmax:
        raise ConfigError("model.moe_router_enable_expert_bias=true needs model.moe_router_score_function=sigmoid "
                          "(as Megatron-LM: the bias shifts sigmoid scores); set one or the other")
    if not model.moe_router_bias_update_rate > 0:
        raise ConfigError(f"model.moe_router_bias_update_rate={model.moe_router_bias_update_rate} must be > 0")


def _check_losses(model) -> None:
    check_choice("model.moe_router_load_balancing_type", model.moe_router_load_balancing_type, LOAD_BALANCING_TYPES)
    if not model.moe_aux_loss_coeff >= 0:
        raise ConfigError(f"model.moe_aux_loss_coeff={model.moe_aux_loss_coeff} must be >= 0")
    z = model.moe_z_loss_coeff
    if z is not None and not z >= 0:
        raise ConfigError(f"model.moe_z_loss_coeff={z} must be >= 0 or null")


def _check_capacity(model) -> None:
    c = model.moe_expert_capacity_factor
    if c is not None and not c > 0:
        raise ConfigError(f"model.moe_expert_capacity_factor={c} must be > 0, or null for dropless routing")
    if model.moe_pad_expert_input_to_capacity and c is None:
        raise ConfigError("model.moe_pad_expert_input_to_capacity=true needs model.moe_expert_capacity_factor "
                          "(dropless experts have no capacity to pad to); set both or neither")
    check_choice("model.moe_token_drop_policy", model.moe_token_drop_policy, TOKEN_DROP_POLICIES)
    check_choice("model.moe_token_dispatcher_type", model.moe_token_dispatcher_type, DISPATCHER_TYPES)


def _check_widths(model, tp: int) -> None:
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        width: Optional[int] = getattr(model, key)
        if width is not None and (not isinstance(width, int) or width < 1):
            raise ConfigError(f"model.{key}={width} must be an integer >= 1 or null")
    shared = model.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ConfigError(f"model.moe_shared_expert_intermediate_size={shared} is not divisible by "
                          f"parallel.tensor_model_parallel_size={tp}; change one of them")
    if model.moe_shared_expert_gate and shared is None:
        raise ConfigError("model.moe_shared_expert_gate=true needs model.moe_shared_expert_intermediate_size (a "
                          "shared expert to gate); set it or the gate to false")


def _check_layout(model, parallel) -> None:
    tp, ep = parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or tp  # Megatron's default: the experts split as the dense layers
    if ep > 1 and etp != tp:
        # whole experts on each TP rank: the expert grid's EP then folds over the TP ranks, whose grads the
        # sequence-parallel TP sum and the grad norm's TP-rank-0 count would mix up
        raise ConfigError(f"parallel.expert_model_parallel_size={ep} with parallel.expert_tensor_parallel_size={etp} "
                          f"!= tensor_model_parallel_size={tp}: expert parallelism needs the experts split as the dense "
                          "layers; set parallel.expert_tensor_parallel_size=null or expert_model_parallel_size=1")
    if etp not in (1, tp):
        raise ConfigError(f"parallel.expert_tensor_parallel_size={etp} must be 1 or tensor_model_parallel_size={tp} "
                          "(null = tp); set one of them")
    if tp > 1 and not parallel.sequence_parallel:
        # Megatron's MoELayer: the router and the dispatcher work on this rank's sequence shard
        raise ConfigError(f"model.num_moe_experts with parallel.tensor_model_parallel_size={tp} needs "
                          "parallel.sequence_parallel=true (each TP rank routes its own sequence shard)")
    f = moe_ffn_hidden_size(model)
    if f % etp:  # each expert's FFN is split over the ETP ranks
        raise ConfigError(f"model.moe_ffn_hidden_size={f} (the expert width) is not divisible by "
                          f"parallel.expert_tensor_parallel_size={etp}; change one of them")


def check_moe_config(model, parallel) -> None:
    """Every ``model.moe_*`` rule (Megatron-core's ``TransformerConfig.__post_init__`` MoE checks); pure.

    Dense models (``num_moe_experts`` null) are not checked. Order: experts, layer pattern, router,
    losses, capacity, widths, linear biases, the layout.

    Raises:
        ConfigError: one line naming the key, the value and the fix.
    """
    if not is_moe(model):
        return
    e = model.num_moe_experts
    if not isinstance(e, int) or e < 1:
        raise ConfigError(f"model.num_moe_experts={e} must be an integer >= 1, or null for a dense model")
    _check_layer_freq(model)
    _check_router(model)
    _check_losses(model)
    _check_capacity(model)
    _check_widths(model, parallel.tensor_model_parallel_size)
    if model.add_bias_linear:
        raise ConfigError("model.num_moe_experts: the routed experts and the router have no linear biases here; set "
                          "model.add_bias_linear=false (as Mixtral, Qwen-MoE and DeepSeek)")
    _check_layout(model, parallel)
