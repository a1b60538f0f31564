"""Mixture-of-Experts terms of the plan: routed rows, an MoE layer's activations, the token dispatch's traffic.

Units: bytes (activations, traffic) and rows (routed token copies). Legend: s = seq_length, b =
micro_batch_size, h = hidden_size, t = tensor_model_parallel_size, E = num_moe_experts, k =
moe_router_topk, f_e = the expert width (`moe_ffn_hidden_size`), f_s = the shared expert's, ep / etp /
edp = the expert grid's sizes (`mptrain.groups.expert_layout`), act = bytes of an activation element.

Routed rows (`routed_rows`): a rank routes T = s·b/t tokens (its sequence shard under sequence
parallelism; MoE with t > 1 needs it) and sends N = T·k rows (dropless). With
``moe_expert_capacity_factor`` c an expert keeps at most cap = ceil(T·k/E·c) of them
(`mptrain.layers.moe.config.expert_capacity`): N ≤ min(T·k, E·cap), or exactly E·min(cap, T) rows with
``moe_pad_expert_input_to_capacity`` (one expert-parallel rank). The plan takes the bound. The experts of a
rank see etp·N rows: UNIFORM ROUTING is assumed (each EP rank receives as many rows as it sends; the ETP
all-gather adds the etp peers' rows), so a rank whose experts are more popular holds more.

Activations of one MoE layer per micro-batch, in place of the dense MLP's fc1 input and MLP split term
(MEASURED on CPU with saved-tensor hooks, tests/test_plan_activations.py re-measures them; in units of
act/2 bytes per element unless in bytes):
    router input x [T, h]                                  2 per element (also the shared expert's fc1 input)
    router scores, top-k, routing map [T, E]               16 bytes per (token, expert), any dtype
    permutation indices (row -> token, row -> slot, and   28 bytes per routed row (24 from the router's top-k
    the combine's gather)                                  form at ep = etp = 1, 32 from the routing map: the mean)
    experts' input rows [etp·N, h]                         2 per element of h (the combine gathers the output
                                                           rows: its backward keeps only their indices)
    experts' intermediates [etp·N, f_e/etp]                SwiGLU 10 (fc1 out 2f_e, silu(gate), their
                                                           product, its probability-weighted copy), GeLU 6
    shared expert (f_s > 0): a dense MLP on every token    `MEASURED`'s split MLP term × f_s/h, split over t;
                                                           under sequence parallelism (t > 1) plus its gathered
                                                           input [s·b, h]
Traffic per rank per optimizer step (bytes SENT, ring collectives as `mptrain.planner.layouts`), per MoE layer
and micro-batch, forward + backward (full recompute: one more forward):
    alltoall   all-to-all over EP of the N rows: (ep − 1)/ep · N·h·act each way (dispatch, combine), the
               same in backward; all-gather / reduce-scatter over ETP: (etp − 1) · N·h·act each
    allgather  all-gather of the T tokens over the etp·ep ranks and reduce-scatter back: (P − 1) · T·h·act
               each, P = etp·ep (plus the forward's gathered probs and routing map, (P − 1)·T·E·(4 + 1) bytes)
    expert grads (ep > 1): all-reduce over the expert-data-parallel group, or reduce-scatter + all-gather under
               ZeRO-1, as the dense grads over DP.
Sources: Megatron-core ``megatron/core/transformer/moe/token_dispatcher.py`` (what each dispatcher sends);
Fedus et al. 2021 (Switch Transformer) §2.2 (capacity).
"""

from __future__ import annotations

from typing import Optional

from mptrain.groups import expert_layout
from mptrain.layers.moe.config import expert_capacity, is_moe_layer, moe_ffn_hidden_size

# MEASURED on CPU (torch 2.13, saved-tensor hooks, unique storages) for our MoELayer: see the module docstring.
# Source: tests/test_plan_activations.py::measure_saved_bytes (h 64, s 32, b 2, E 4 and 8, k 1 and 2, f_e h and 2h).
MOE_MEASURED = {
    "mlp_input_16bit": 2.0,  # the dense fc1 input's share of MEASURED["linear_inputs_16bit"]: the router's input here
    "router_input_16bit": 2.0,  # x [T, h], saved by the router's GEMM (the shared expert's fc1 reads the same x)
    "router_bytes_per_token_expert": 16.0,  # scores / top-k / routing map [T, E]
    "index_bytes_per_row": 28.0,  # the permutation's int64 maps: 24 (top-k form) to 32 (routing map) per row
    "expert_rows_16bit": 2.0,  # the experts' input rows, per element of h
    "expert_split_per_ffn_16bit": {"gelu": 6.0, "swiglu": 10.0},  # per element of f_e / etp
}


def is_moe_model(model) -> bool:
    """``model.num_moe_experts`` is set (a config object of another kind may lack the key: dense)."""
    return getattr(model, "num_moe_experts", None) is not None


def moe_layer_share(model, layers) -> float:
    """The share of ``layers`` (global indices) that are MoE layers; 0 for a dense model or no layers."""
    layers = list(layers)
    if not is_moe_model(model) or not layers:
        return 0.0
    return sum(is_moe_layer(model, n) for n in layers) / len(layers)


def expert_data_parallel_size(cfg, *, tp: int, pp: int, dp: int, ep: int) -> int:
    """edp = world / (etp·ep·pp) with world = tp·pp·dp and etp = ``parallel.expert_tensor_parallel_size``
    (null = tp): the group the expert grads reduce over (`mptrain.groups.expert_layout`)."""
    return expert_layout(tp * pp * dp, tp, pp, ep, cfg.parallel.expert_tensor_parallel_size)[2]


def routed_tokens(cfg, tp: int) -> float:
    """T: tokens one rank routes per micro-batch, s·b/t (its sequence shard when t > 1)."""
    m = cfg.model
    return m.seq_length * cfg.train.micro_batch_size / tp


def routed_rows(cfg, *, tp: int, ep: int, etp: int) -> float:
    """N: rows one rank sends to the experts per MoE layer and micro-batch (module docstring): T·k dropless, at
    most E·cap with a capacity factor, exactly E·min(cap, T) when padded to capacity on one expert rank."""
    m = cfg.model
    tokens, k, e = routed_tokens(cfg, tp), m.moe_router_topk, m.num_moe_experts
    if m.moe_expert_capacity_factor is None:
        return tokens * k
    cap = expert_capacity(int(tokens), k, e, m.moe_expert_capacity_factor)
    if m.moe_pad_expert_input_to_capacity and ep * etp == 1:  # only the local dispatcher pads
        return e * min(cap, tokens)
    return min(tokens * k, e * cap)


def _etp(cfg, tp: int) -> int:
    return cfg.parallel.expert_tensor_parallel_size or tp


def moe_mlp_activation_bytes(cfg, *, tp: int, ep: int, sequence_parallel: bool, act_bytes: float,
                             split_mlp_per_ffn_16bit: dict) -> float:
    """Bytes one MoE layer's router, dispatch, experts and shared expert keep for backward per micro-batch on one
    rank (module docstring). ``split_mlp_per_ffn_16bit``: the dense MLP's measured split term (the shared expert's).
    """
    m, c = cfg.model, MOE_MEASURED
    h, scale, etp = m.hidden_size, act_bytes / 2, _etp(cfg, tp)
    tokens = routed_tokens(cfg, tp)
    rows = routed_rows(cfg, tp=tp, ep=ep, etp=etp)
    expert_rows = etp * rows  # uniform routing: as many rows arrive over EP as leave; ETP gathers its peers'
    router = tokens * (c["router_input_16bit"] * scale * h + c["router_bytes_per_token_expert"] * m.num_moe_experts)
    experts = expert_rows * scale * (c["expert_rows_16bit"] * h + c["expert_split_per_ffn_16bit"][m.activation]
                                     * moe_ffn_hidden_size(m) / etp)
    total = router + rows * c["index_bytes_per_row"] + experts
    f_s = m.moe_shared_expert_intermediate_size or 0
    if f_s:
        sbh = m.seq_length * cfg.train.micro_batch_size * h
        total += sbh * split_mlp_per_ffn_16bit[m.activation] * scale * f_s / h / tp
        if sequence_parallel and tp > 1:  # its column-parallel fc1 saves the gathered input, not the shard
            total += sbh * act_bytes
    return total


def dispatch_bytes_per_layer(cfg, *, tp: int, ep: int, act_bytes: float, recompute: Optional[str]) -> float:
    """Bytes one rank sends per MoE layer and micro-batch through ``model.moe_token_dispatcher_type`` (module
    docstring: forward and backward, full recompute one more forward); 0 where one rank holds whole experts for
    its own tokens (ep = etp = 1)."""
    m = cfg.model
    etp = _etp(cfg, tp)
    if ep * etp == 1:
        return 0.0
    forwards = 2 if recompute == "full" else 1
    passes = 2 * forwards + 2  # dispatch and combine in each forward, their mirrors in the backward
    h = m.hidden_size
    if m.moe_token_dispatcher_type == "allgather":
        tokens, group = routed_tokens(cfg, tp), etp * ep
        routing = forwards * (group - 1) * tokens * m.num_moe_experts * (4 + 1)  # fp32 probs and the bool map
        return passes * (group - 1) * tokens * h * act_bytes + routing
    rows = routed_rows(cfg, tp=tp, ep=ep, etp=etp)  # the rows' probabilities (1/h of them) are left out
    return passes * rows * h * act_bytes * ((ep - 1) / ep + (etp - 1))
