"""The host-overhead paths, CPU side: the ``model.compile_scope`` / ``compile_mode`` rules, the
start-up line that says what is compiled.

The compiled chunk's arithmetic (against eager, tp 1 and 2, with SP) is tests/test_bench_compile.py;
on CUDA, tests/test_gpu_compile_chunk.py (marker gpu).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mptrain.config.model import ModelConfig
from mptrain.config.parallel import ParallelConfig
from mptrain.errors import ConfigError
from mptrain.layers.compile import chunk_compile_blocker, compile_mode_for, resolve_compile_layers
from mptrain.layers.gpt import check_model_config
from mptrain.training.recorder import compile_note

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _groups(tp=1, pp=1):
    return SimpleNamespace(tp_size=tp, pp_size=pp)


@pytest.mark.parametrize("override, want", [
    ({}, None),
    ({"recompute_granularity": "selective"}, None),  # torch's checkpoint inside the graph (layers/random.py)
    ({"recompute_granularity": "full", "recompute_num_layers": 1}, None),
    ({"attention_dropout": 0.1}, None),  # drawn in the graph: slices of an all-heads mask (layers/random.py)
    ({"hidden_dropout": 0.1}, None),
])
def test_chunk_compile_blocker(override, want):
    got = chunk_compile_blocker(ModelConfig(**override), sequence_parallel=False)
    assert (got is None) if want is None else got.startswith(want), got


def test_dropout_does_not_block_the_chunk_graph_under_sp():
    cfg = ModelConfig(hidden_dropout=0.1, attention_dropout=0.1)
    assert chunk_compile_blocker(cfg, sequence_parallel=True) is None


@pytest.mark.parametrize("value, device, want", [
    (None, CUDA, (True, "default on CUDA; model.compile_layers=false for eager")),
    (None, CPU, (False, "default: eager on cpu; model.compile_layers=true compiles")),
    (False, CUDA, (False, "model.compile_layers=false")),
    (True, CPU, (True, "model.compile_layers=true")),
])
def test_compile_layers_default_is_on_for_cuda_only(value, device, want):
    assert resolve_compile_layers(ModelConfig(compile_layers=value), device) == want


@pytest.mark.parametrize("mode, device, tp, pp, chunk, want", [
    ("auto", CUDA, 1, 1, True, "reduce-overhead"),
    ("auto", CUDA, 1, 1, False, None),   # per-layer graphs: Inductor's default
    ("auto", CUDA, 2, 1, True, None),    # NCCL collectives in the graph
    ("auto", CUDA, 1, 2, True, None),    # 1F1B holds several micro-batches' outputs
    ("auto", CPU, 1, 1, True, None),
    (None, CUDA, 1, 1, True, None),
    ("max-autotune", CPU, 2, 2, True, "max-autotune"),
])
def test_compile_mode_for(mode, device, tp, pp, chunk, want):
    assert compile_mode_for(ModelConfig(compile_mode=mode), _groups(tp, pp), device, chunk) == want


@pytest.mark.parametrize("key, value", [("compile_scope", "graph"), ("compile_mode", "fast")])
def test_bad_compile_keys_are_one_line(key, value):
    with pytest.raises(ConfigError, match=rf"^model\.{key}: unknown option '{value}'; valid: .*; set model\.{key}"):
        check_model_config(dataclasses.replace(ModelConfig(), **{key: value}), ParallelConfig())


def _chunk(**kw):
    inner = SimpleNamespace(config=SimpleNamespace(compile_layers=kw.pop("compile_layers", True)), **kw)
    return SimpleNamespace(module=inner)  # a DDP-like wrapper: compile_note looks through .module


def test_compile_note_says_what_is_compiled():
    assert compile_note([_chunk(compile_layers=False, compiled_chunk=False)]) == ""
    assert compile_note([_chunk(compiled_chunk=True, compile_mode="reduce-overhead")]) == \
        " compile=chunk (one graph per model chunk, mode reduce-overhead)"
    assert compile_note([_chunk(compiled_chunk=True, compile_mode=None)] * 2) == \
        " compile=chunk (one graph per model chunk, mode default)"
    blocked = _chunk(compiled_chunk=False, compile_blocker="model.recompute_granularity=full (x)")
    assert compile_note([blocked]) == " compile=layer (chunk graph: model.recompute_granularity=full (x))"


def _notes(rank, world):
    from mptrain.groups import build_groups
    from mptrain.layers.gpt import GPTModel

    g = build_groups(1, 1)
    try:
        out = []
        for scope, recompute, on in (("layer", None, True), ("chunk", "selective", True), ("chunk", None, True),
                                     ("chunk", None, None)):
            cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                              compile_layers=on, compile_scope=scope, recompute_granularity=recompute)
            model = GPTModel(cfg, g, parallel=ParallelConfig(), pre_process=True, post_process=True,
                             layer_numbers=[0], vocab_size=32)
            out.append(compile_note([model]))  # torch.compile is lazy: nothing compiles here
        # the chunk graph under FSDP2 (ZeRO-3 over the one rank, offloaded): each layer its own graph and unit
        from torch.distributed.fsdp import FSDPModule

        from mptrain.distributed.fsdp import FullyShardedDataParallel

        cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, compile_layers=True)
        model = GPTModel(cfg, g, parallel=ParallelConfig(), pre_process=True, post_process=True, layer_numbers=[0],
                         vocab_size=32)
        assert model.compiled_chunk
        FullyShardedDataParallel(model, g, strategy="optim_grads_params", compute_dtype=torch.float32, cpu_offload=True)
        layer = model.decoder.layers["0"]
        out.append((compile_note([model]), model.compiled_chunk, model._compiled_forward is None,
                    layer._compiled_body is not None, isinstance(layer, FSDPModule)))
        return out
    finally:
        g.destroy()


def test_layer_scope_is_its_own_reason():
    from harness import run_distributed

    assert run_distributed(_notes, 1)[0] == [
        " compile=layer (chunk graph: model.compile_scope=layer; model.compile_layers=true)",
        " compile=chunk (one graph per model chunk, mode default; model.compile_layers=true)",
        " compile=chunk (one graph per model chunk, mode default; model.compile_layers=true)",
        " compile=off (default: eager on cpu; model.compile_layers=true compiles)",
        (" compile=layer (chunk graph: ZeRO-2 / ZeRO-3: FSDP2 gathers each layer's params around that layer's graph; "
         "model.compile_layers=true)", False, True, True, True),
    ]


def _moe_notes(rank, world):
    from mptrain.groups import build_groups
    from mptrain.layers.gpt import GPTModel

    g = build_groups(1, 1)
    try:
        out = []
        for scope, on, capacity in (("chunk", True, None), ("layer", True, None), ("chunk", True, 1.0),
                                    ("chunk", None, None)):
            cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, compile_layers=on,
                              compile_scope=scope, num_moe_experts=2, moe_router_topk=2, activation="swiglu",
                              add_bias_linear=False, moe_expert_capacity_factor=capacity)
            model = GPTModel(cfg, g, parallel=ParallelConfig(), pre_process=True, post_process=True,
                             layer_numbers=[0], vocab_size=32)
            out.append((compile_note([model]), model.compiled_chunk, model.decoder.layers["0"].mlp.traceable))
        return out
    finally:
        g.destroy()


def test_moe_layers_compile_where_static_and_the_line_says_which():
    """An MoE model at ep 1, dropless: its MoE layers are traced with the rest, so the chunk is one graph and the
    kernels: line says so; with a capacity factor (no padding) they run eagerly, the chunk graph falls back to layer
    graphs and the line says why; nothing of MoE when nothing compiles."""
    from harness import run_distributed
    from mptrain.layers.compile import MOE_COMPILED, MOE_EAGER

    assert MOE_COMPILED == "MoE layers in the graph (ep = etp = 1, static token counts)"
    capacity = f"{MOE_EAGER} (a capacity factor without padding: the kept rows depend on the routing)"
    assert run_distributed(_moe_notes, 1)[0] == [
        (f" compile=chunk (one graph per model chunk, mode default; {MOE_COMPILED}; model.compile_layers=true)",
         True, True),
        (f" compile=layer (chunk graph: model.compile_scope=layer; {MOE_COMPILED}; model.compile_layers=true)",
         False, True),
        (f" compile=layer (chunk graph: {capacity}; model.compile_layers=true)", False, False),
        (" compile=off (default: eager on cpu; model.compile_layers=true compiles)", False, True),
    ]


@pytest.mark.parametrize("override, grid, want", [
    ({}, (1, 1, False), None),
    ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, (1, 1, False), None),
    ({}, (2, 1, False), "expert parallelism: the token dispatch's split sizes depend on the routing"),
    ({}, (1, 2, False), "expert parallelism: the token dispatch's split sizes depend on the routing"),
    ({"moe_grouped_gemm": False}, (1, 1, False),
     "model.moe_grouped_gemm=false: the per-expert loop reads its split sizes on the host"),
    ({}, (1, 1, True), "sequence parallelism: the router sums its counts over TP with in-place collectives"),
])
def test_moe_eager_reason(override, grid, want):
    from mptrain.layers.compile import MOE_EAGER, moe_eager_reason

    cfg = ModelConfig(num_moe_experts=4, moe_router_topk=2, **override)
    assert moe_eager_reason(cfg, *grid) == want
    assert chunk_compile_blocker(cfg, grid[2], grid[0], grid[1]) == (None if want is None else f"{MOE_EAGER} ({want})")
    assert moe_eager_reason(ModelConfig(), 2, 2, True) is None  # a dense model


class _FakeSizevars:
    @staticmethod
    def statically_known_leq(a, b):
        return a <= b


class _FakeFeatures:
    def __init__(self, hint, numel):
        self.hint, self.reduction_numel = hint, numel

    def get_reduction_hint(self):
        return self.hint


@pytest.mark.parametrize("hint, numel, want", [
    ("INNER", 512, True),  # Inductor's own rule (up to 1024)
    ("INNER", 2048, True),  # a norm over h = 2048: Inductor alone would loop twice over the row
    ("INNER", 4096, False),  # above PERSISTENT_ROW_REDUCTION_MAX: Inductor's looped kernel
    ("OUTER", 2048, False),  # a column reduction (a bias grad): Inductor's own rule
])
def test_norms_over_the_hidden_dim_are_persistent_reductions(hint, numel, want):
    import sympy
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    from mptrain.layers.inductor_choices import PersistentNorms

    graph = SimpleNamespace(sizevars=_FakeSizevars())
    with V.set_graph_handler(graph):
        features = _FakeFeatures(getattr(ReductionHint, hint), sympy.Integer(numel))
        got = PersistentNorms.should_use_persistent_reduction(features, False)
    assert got is want


def test_install_sets_the_choices_and_keeps_a_users_own():
    import torch._inductor.config as inductor_config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    from mptrain.layers import inductor_choices

    class Users(InductorChoices):
        def uuid(self):
            return "users"

    has_key = hasattr(inductor_config, "inductor_choices_class")
    prior_class = getattr(inductor_config, "inductor_choices_class", None)
    restore = V.set_choices_handler(InductorChoices())  # Inductor's plain default on this thread; restored on exit
    try:
        with restore:
            if has_key:
                inductor_config.inductor_choices_class = None
            assert "persistent" in inductor_choices.install()
            assert type(V.choices) is inductor_choices.PersistentNorms
            if has_key:  # what other threads (the autograd thread's backward compiles) build theirs from
                assert inductor_config.inductor_choices_class is inductor_choices.PersistentNorms
                inductor_config.inductor_choices_class = Users  # a class of the user's own: kept
                assert inductor_choices.install() == "kept the configured Inductor choices"
                assert inductor_config.inductor_choices_class is Users
                inductor_config.inductor_choices_class = None
            V.set_choices_handler(Users())  # a handler of the user's own on this thread: kept
            assert inductor_choices.install() == "kept the configured Inductor choices"
            assert type(V.choices) is Users
    finally:
        if has_key:
            inductor_config.inductor_choices_class = prior_class


@pytest.mark.parametrize("device, compile_layers, installs", [(CUDA, True, True), (CPU, True, False),
                                                              (CUDA, False, False)])
def test_apply_compile_installs_the_heuristics_for_cuda_only(device, compile_layers, installs, monkeypatch):
    """The C++ code generation of CPU compiles never consults Inductor's choices: nothing is changed there."""
    from mptrain.layers import inductor_choices
    from mptrain.layers.compile import apply_compile, plan_compile

    calls = []
    monkeypatch.setattr(inductor_choices, "install", lambda: calls.append(1))
    compiled = []
    model = SimpleNamespace(compile=lambda mode: compiled.append(mode))
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, compile_layers=compile_layers)
    plan = plan_compile(cfg, _groups(), device, sequence_parallel=False)
    assert plan.cuda is (device.type == "cuda")
    apply_compile(model, plan)
    assert calls == ([1] if installs else []) and compiled == ([plan.mode] if compile_layers else [])
