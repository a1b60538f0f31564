"""The MoE layer against a per-token reference written here (CPU, fp32): outputs, the aux and z losses'
gradients, capacity dropping, ties, grouped GEMMs vs the per-expert loop, the expert-bias update, the rules.

The reference loops over tokens and their top-k experts with plain tensor ops, so it shares no code with
`mptrain.layers.moe` but the weights. Tolerance: the layer groups rows into GEMMs and sums a token's k
outputs in another order than the loop, so fp32 results agree to rounding (rtol 1e-5).
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mptrain.checkpoint.offline import single_rank_groups
from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.errors import ConfigError
from mptrain.layers.context import LayerContext
from mptrain.layers.gpt import check_model_config
from mptrain.layers.moe import MoELayer, set_aux_loss_scale, update_expert_bias
from mptrain.layers.random import ParamInit

S, B, H, E = 6, 3, 16, 4  # T = 18 tokens
SCALE = 0.37  # the aux losses' backward scale (the trainer's loss_scale / (micro-batches · dp))
BASE = dict(num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=2,
            moe_ffn_hidden_size=8, add_bias_linear=False, activation="swiglu")


def _layer(**over):
    cfg = ModelConfig(**{**BASE, **over})
    check_model_config(cfg, ParallelConfig())
    ctx = LayerContext(groups=single_rank_groups(), init=ParamInit(seed=7, std=0.5, num_layers=2))
    layer = MoELayer(cfg, ctx, layer_number=0)
    set_aux_loss_scale(layer, SCALE)
    return cfg, layer


def _input(seed=0, dup=False):
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed))
    if dup:  # identical tokens: equal scores everywhere (the capacity's tie rule decides)
        x[:] = x[0, 0]
    return x.requires_grad_(True)


def _top(values: torch.Tensor, k: int) -> list:
    """The k largest entries' indices, ties to the lower index (the documented rule), by a Python sort."""
    values = values.detach()
    return sorted(range(len(values)), key=lambda i: (-float(values[i]), i))[:k]


def _close(got, want, msg=""):
    """Equal to fp32 rounding: rtol 1e-5, and an absolute slack of 1e-5 of the tensor's largest entry (an entry
    near zero is a difference of large terms, whose rounding scales with them)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.detach().abs().max().clamp(min=1e-3)), msg=msg)


def _route(cfg, logits_t, bias):
    """(experts, weights) of one token, as topk_weights documents it."""
    k = cfg.moe_router_topk
    if cfg.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits_t)
        sel = _top(scores + (bias if bias is not None else 0), k)
        w = scores[sel]
        w = w / (w.sum() + 1e-20) if k > 1 else w
    elif cfg.moe_router_pre_softmax:
        scores = torch.softmax(logits_t, -1)
        sel = _top(scores, k)
        w = scores[sel]
    else:
        sel = _top(logits_t, k)
        w = torch.softmax(logits_t[sel], -1)
    return sel, w * (cfg.moe_router_topk_scaling_factor or 1.0)


def _capacity_keep(cfg, routes, num_tokens):
    """{(t, e)} kept by the capacity (policy probs: highest weight, earlier token on ties; position: earliest)."""
    import math

    cap = math.ceil(num_tokens * cfg.moe_router_topk / E * cfg.moe_expert_capacity_factor)
    keep = set()
    for e in range(E):
        mine = [(t, float(w[sel.index(e)].detach())) for t, (sel, w) in enumerate(routes) if e in sel]
        if cfg.moe_token_drop_policy == "probs":
            mine.sort(key=lambda tw: (-tw[1], tw[0]))
        keep |= {(t, e) for t, _ in mine[:cap]}
    return keep


def _reference(cfg, layer, x):
    """(output [S, B, H], aux + z loss) by a loop over tokens and their experts."""
    r, ex = layer.router, layer.experts
    w1, w2 = ex.linear_fc1.weight, ex.linear_fc2.weight
    tokens = x.reshape(-1, H)
    logits = tokens @ r.weight.t()
    routes = [_route(cfg, logits[t], r.expert_bias) for t in range(len(tokens))]
    keep = None if cfg.moe_expert_capacity_factor is None else _capacity_keep(cfg, routes, len(tokens))
    out = []
    for t, (sel, w) in enumerate(routes):
        y = torch.zeros(H)
        for e, p in zip(sel, w):
            if keep is None or (t, e) in keep:
                gate, up = (tokens[t] @ w1[e].t()).chunk(2)
                y = y + (F.silu(gate) * up * p) @ w2[e].t()
        out.append(y)
    out = torch.stack(out).reshape(S, B, H)
    if layer.shared_experts is not None:
        sh = layer.shared_experts
        gate, up = (x @ sh.linear_fc1.weight.t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ sh.linear_fc2.weight.t()
        if sh.gate_weight is not None:
            y = y * torch.sigmoid(x @ sh.gate_weight.t())
        out = out + y
    return out, _aux_reference(cfg, logits) + _z_reference(cfg, logits)


def _aux_reference(cfg, logits):
    """Switch loss: coeff · E · Σ_i f_i · P_i per group of tokens (the micro-batch, or each sequence)."""
    if not cfg.moe_aux_loss_coeff or cfg.moe_router_load_balancing_type == "none":
        return 0.0
    k = cfg.moe_router_topk
    if cfg.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / scores.sum(-1, keepdim=True)
    t_all = torch.arange(len(logits))
    groups = ([t_all] if cfg.moe_router_load_balancing_type == "aux_loss"
              else [t_all[t_all % B == b] for b in range(B)])  # tokens are sequence-major: t = s·B + b
    total = 0.0
    for idx in groups:
        counts = torch.zeros(E)
        for t in idx:
            counts[_top(scores[t], k)] += 1
        f, p = counts / (len(idx) * k), scores[idx].mean(0)
        total = total + cfg.moe_aux_loss_coeff * E * (f * p).sum()
    return total / len(groups)


def _z_reference(cfg, logits):
    if not cfg.moe_z_loss_coeff:
        return 0.0
    return cfg.moe_z_loss_coeff * (torch.logsumexp(logits, -1) ** 2).mean()


CASES = {
    "softmax_aux_z_shared_gate": dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                                      moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
    "pre_softmax_top1_scaled": dict(moe_router_topk=1, moe_router_pre_softmax=True,
                                    moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.1),
    "sigmoid_bias_seq_aux": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                 moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1),
    "capacity_probs": dict(moe_expert_capacity_factor=1.0, moe_aux_loss_coeff=0.1),
    "capacity_position_padded": dict(moe_expert_capacity_factor=0.8, moe_token_drop_policy="position",
                                     moe_pad_expert_input_to_capacity=True),
    "per_expert_loop": dict(moe_grouped_gemm=False, moe_z_loss_coeff=0.01),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_the_per_token_reference_forward_and_grads(case):
    cfg, layer = _layer(**CASES[case])
    if layer.router.expert_bias is not None:  # a bias that changes the choice of some tokens
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.05, 0.0]))
    x = _input()
    g = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    params = [x] + [p for p in layer.parameters()]
    out = layer(x)
    got = torch.autograd.grad((out * g).sum(), params)
    ref, aux = _reference(cfg, layer, x)
    want = torch.autograd.grad((ref * g).sum() + SCALE * aux, params, allow_unused=True)
    _close(out, ref)
    for name, a, b in zip(["x"] + [n for n, _ in layer.named_parameters()], got, want):
        _close(a, torch.zeros_like(a) if b is None else b, msg=name)
    assert float(layer.router.routing_stats[:E].sum()) == S * B * cfg.moe_router_topk  # counted once


def test_capacity_drops_what_the_reference_drops():
    cfg, layer = _layer(moe_expert_capacity_factor=0.5)
    x = _input(3)
    with torch.no_grad():
        out = layer(x)
        ref, _ = _reference(cfg, layer, x)
    _close(out, ref)
    dropped = float(layer.router.routing_stats[E])
    assert dropped == 0  # counted only in training with grad on
    layer(x).sum().backward()
    assert float(layer.router.routing_stats[E]) == S * B * 2 - E * 5  # capacity ceil(18·2/4·0.5) = 5 per expert


def test_ties_go_to_the_lower_expert_index_and_the_earlier_token():
    cfg, layer = _layer(moe_expert_capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight.copy_(layer.router.weight[:1].expand(E, H))  # equal logits for every expert
    probs, routing_map = layer.router(_input(dup=True))
    assert routing_map[:5].tolist() == [[True, True, False, False]] * 5  # experts 0 and 1: the lower indices
    assert not routing_map[5:].any()  # capacity 5 each: the first five of the equal tokens
    torch.testing.assert_close(probs[:5, :2], torch.full((5, 2), 0.5))


@pytest.mark.parametrize("k", [1, 3])
def test_dispatch_from_the_topk_form_equals_the_routing_map_dispatch(k):
    """`LocalDispatcher.dispatch_topk` (each token's k experts in score order) gives the rows, counts and weights that
    `dispatch` gives on the [T, E] form of the same routing, and combine's output and the grads of the hidden rows
    and the weights are equal bit for bit, with the slots summed by gathers or through a zeroed buffer (k = 3: the
    order of a token's three rows in its sum is the expert order either way)."""
    from mptrain.layers.moe import LocalDispatcher
    from mptrain.layers.moe.dispatch_ep import unpermute
    from mptrain.layers.moe.routing import routing_from_indices

    t, e = 10, 6
    gen = torch.Generator().manual_seed(4)
    indices = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k]  # distinct experts per token, not in index order
    weights = torch.rand(t, k, generator=gen)
    hidden, g = torch.randn(t, H, generator=gen), torch.randn(t, H, generator=gen)
    got = []
    for topk_form in (True, False):
        h, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        dispatcher = LocalDispatcher(e, k)
        if topk_form:
            rows, counts, row_probs = dispatcher.dispatch_topk(h, indices, w)
        else:
            rows, counts, row_probs = dispatcher.dispatch(h, *routing_from_indices(torch.zeros(t, e), indices, w))
        perm = dispatcher._perm
        expert_out = rows * row_probs.unsqueeze(1) * 1.5
        buffered = unpermute(expert_out.detach(), dataclasses.replace(perm, slot_rows=None))
        out = dispatcher.combine(expert_out)
        out.backward(g)
        got.append([rows, counts, row_probs, perm.rows_token, perm.rows_slot, out, buffered, h.grad, w.grad])
    for name, a, b in zip(["rows", "counts", "probs", "token", "slot", "out", "buffered", "dh", "dw"], *got):
        assert torch.equal(a, b), name
    assert got[0][1].tolist() == torch.bincount(indices.reshape(-1), minlength=e).tolist()
    assert torch.equal(got[0][5], got[0][6])  # the gathered sums are the buffer's


def test_the_grouped_gemm_probe_answers_the_same_with_grad_off():
    """The probe runs once per process; a first caller holding grad off (generation, evaluation) gets the answer
    a training step would (its backward needs grad)."""
    from mptrain.layers.moe.experts import _grouped_mm_runs

    _grouped_mm_runs.cache_clear()
    try:
        with torch.no_grad():
            off = _grouped_mm_runs("cpu", torch.float32)
        _grouped_mm_runs.cache_clear()
        assert off == _grouped_mm_runs("cpu", torch.float32) is None  # CPU torch with torch._grouped_mm
    finally:
        _grouped_mm_runs.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop(dtype):
    _, grouped = _layer()
    _, loop = _layer(moe_grouped_gemm=False)
    grouped, loop = grouped.to(dtype), loop.to(dtype)
    assert grouped.experts.kernel() == ("grouped_mm", "") and loop.experts.kernel()[0] == "loop"
    x1, x2 = (_input(5).detach().to(dtype).requires_grad_(True) for _ in range(2))
    y1, y2 = grouped(x1), loop(x2)
    y1.float().square().sum().backward()
    y2.float().square().sum().backward()
    # the same GEMMs per expert, grouped or one by one: equal up to the kernel's accumulation order
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y1, y2, **tol)
    torch.testing.assert_close(x1.grad, x2.grad, **tol)
    for (name, p), q in zip(grouped.named_parameters(), loop.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


def test_expert_tensor_parallel_shards_sum_to_the_whole_experts():
    """GroupedMLP's ETP layout (fc1 [E, [gate_r; up_r], h], fc2 [E, h, f/etp]): the ranks' partial outputs sum
    to the unsharded experts' output (the sum a dispatcher's combine reduces over the ETP group)."""
    from mptrain.layers.moe import GroupedMLP
    from mptrain.layers.sharding import collect_shard_specs, place_shard

    cfg = ModelConfig(**BASE)
    ctx = LayerContext(groups=single_rank_groups(), init=ParamInit(seed=7, std=0.5, num_layers=2))
    whole = GroupedMLP(cfg, ctx, layer_number=0, num_local_experts=E)
    shards = [GroupedMLP(cfg, ctx, layer_number=0, num_local_experts=E, etp_rank=r, etp_size=2) for r in range(2)]
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(2))
    counts, probs = torch.tensor([3, 0, 5, 2]), torch.rand(10, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(sum(s(x, counts, probs) for s in shards), whole(x, counts, probs), rtol=1e-5, atol=1e-6)
    specs = [collect_shard_specs(s) for s in shards]
    assert specs[1]["linear_fc1.weight"].partition_dim == 1 and specs[1]["linear_fc2.weight"].offset == 4
    for name in ("linear_fc1.weight", "linear_fc2.weight"):  # the shards rebuild the global [E, ...] tensor
        full = torch.zeros(specs[0][name].global_shape)
        for shard, spec in zip(shards, specs):
            place_shard(full, dict(shard.named_parameters())[name].detach(), spec[name])
        torch.testing.assert_close(full, dict(whole.named_parameters())[name].detach())


def test_expert_bias_steps_against_the_load_and_stays_fp32():
    _, layer = _layer(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_bias_update_rate=0.25)
    layer.to(torch.bfloat16)  # a Float16Module cast: the bias and the counts stay fp32
    assert layer.router.expert_bias.dtype == torch.float32 and layer.router.weight.dtype == torch.bfloat16
    layer.router.local_tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 6.0, 6.0]))  # mean 6
    update_expert_bias([layer], single_rank_groups())
    assert layer.router.expert_bias.tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert layer.router.local_tokens_per_expert.tolist() == [0.0] * E
    with torch.no_grad():  # evaluation does not count
        layer(_input().to(torch.bfloat16))
    assert layer.router.local_tokens_per_expert.tolist() == [0.0] * E


def test_parameters_have_megatron_names_and_the_global_expert_axis():
    _, layer = _layer(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"router.weight": (E, H), "experts.linear_fc1.weight": (E, 16, H),
                      "experts.linear_fc2.weight": (E, H, 8), "shared_experts.gate_weight": (1, H),
                      "shared_experts.linear_fc1.weight": (16, H), "shared_experts.linear_fc2.weight": (H, 8)}
    from mptrain.layers.sharding import collect_shard_specs

    specs = collect_shard_specs(layer)
    assert specs["experts.linear_fc1.weight"].global_shape == (E, 16, H)
    # each expert drawn from its own name: expert 2 does not depend on how many experts a rank holds
    init = ParamInit(seed=7, std=0.5, num_layers=2)
    torch.testing.assert_close(layer.experts.linear_fc1.weight[2],
                               init.normal("decoder.layers.0.mlp.experts.linear_fc1.weight2", (16, H)))


@pytest.mark.parametrize("over,message", [
    (dict(moe_router_topk=5), "model.moe_router_topk=5 must be between 1 and model.num_moe_experts=4"),
    (dict(moe_router_topk=1), "model.moe_router_topk=1 with post-softmax routing gives the router no gradient"),
    (dict(moe_router_enable_expert_bias=True), "model.moe_router_enable_expert_bias=true needs "
                                               "model.moe_router_score_function=sigmoid"),
    (dict(moe_expert_capacity_factor=0.0), "model.moe_expert_capacity_factor=0.0 must be > 0"),
    (dict(moe_pad_expert_input_to_capacity=True), "model.moe_pad_expert_input_to_capacity=true needs "
                                                  "model.moe_expert_capacity_factor"),
    (dict(moe_layer_freq=[1, 0, 1]), "model.moe_layer_freq has 3 entries [1, 0, 1]; it needs model.num_layers=2"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "model.moe_router_load_balancing_type: unknown option"),
    (dict(add_bias_linear=True), "model.num_moe_experts: the routed experts and the router have no linear biases"),
])
def test_moe_rules_are_one_line_naming_the_key(over, message):
    with pytest.raises(ConfigError) as err:
        check_model_config(ModelConfig(**{**BASE, **over}), ParallelConfig())
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_tensor_parallelism_needs_sequence_parallelism_and_a_divisible_expert_width():
    cfg = ModelConfig(**BASE)
    with pytest.raises(ConfigError, match="needs parallel.sequence_parallel=true"):
        check_model_config(cfg, ParallelConfig(tensor_model_parallel_size=2))
    check_model_config(cfg, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    with pytest.raises(ConfigError, match=r"model.moe_ffn_hidden_size=9 \(the expert width\) is not divisible by "
                                          "parallel.expert_tensor_parallel_size=2"):
        check_model_config(dataclasses.replace(cfg, moe_ffn_hidden_size=9),
                           ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    check_model_config(dataclasses.replace(cfg, moe_ffn_hidden_size=9),  # whole experts on each TP rank
                       ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                      expert_tensor_parallel_size=1))
    with pytest.raises(ConfigError, match="parallel.expert_tensor_parallel_size=2 must be 1 or "
                                          "tensor_model_parallel_size=4"):
        check_model_config(dataclasses.replace(cfg, num_attention_heads=4),
                           ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True,
                                          expert_tensor_parallel_size=2))
    check_model_config(cfg, ParallelConfig(expert_model_parallel_size=2))
    check_model_config(cfg, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                           pipeline_model_parallel_size=2, expert_model_parallel_size=2))
    with pytest.raises(ConfigError, match=r"parallel.expert_model_parallel_size=2 with parallel.expert_tensor_parallel_"
                                          r"size=1 != tensor_model_parallel_size=2: expert parallelism needs the experts"):
        check_model_config(cfg, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                               expert_model_parallel_size=2, expert_tensor_parallel_size=1))


def test_moe_layer_freq_selects_the_layers():
    from mptrain.layers.moe import moe_layer_pattern

    cfg = ModelConfig(**{**BASE, "num_layers": 6, "moe_layer_freq": 2})
    assert moe_layer_pattern(cfg) == [True, False, True, False, True, False]
    assert moe_layer_pattern(dataclasses.replace(cfg, moe_layer_freq=[0, 1, 1, 0, 0, 1])) == \
        [False, True, True, False, False, True]
    assert moe_layer_pattern(dataclasses.replace(cfg, num_moe_experts=None)) == [False] * 6
