"""`LayerContext`: the one record every parallel layer is built with, derived from the `parallel` config."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from mptrain.config.parallel import ParallelConfig
from mptrain.layers.context import LayerContext, layer_context
from mptrain.layers.random import ParamInit

INIT = ParamInit(seed=3, std=0.02, num_layers=2, device=torch.device("cpu"))


@pytest.mark.parametrize("tp, sp, want", [(1, True, False), (2, True, True), (2, False, False)])
def test_sequence_parallel_is_effective_only_with_tp(tp, sp, want):
    ctx = layer_context(ParallelConfig(sequence_parallel=sp), SimpleNamespace(tp_size=tp), init=INIT)
    assert ctx.sequence_parallel is want


def test_parallel_options_dtype_and_device_reach_the_context():
    parallel = ParallelConfig(async_tensor_model_parallel_allreduce=False, gradient_accumulation_fusion=False,
                              tp_comm_overlap=True)
    groups = SimpleNamespace(tp_size=2)
    ctx = layer_context(parallel, groups, init=INIT, params_dtype=torch.bfloat16)
    assert (ctx.async_tensor_model_parallel_allreduce, ctx.gradient_accumulation_fusion, ctx.tp_comm_overlap) == \
        (False, False, True)
    assert ctx.groups is groups and ctx.init is INIT and ctx.params_dtype == torch.bfloat16
    assert ctx.device == torch.device("cpu")  # None: the init's device
    meta = LayerContext(groups=groups, init=INIT, device=torch.device("meta"))
    assert meta.device == torch.device("meta")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.sequence_parallel = True  # one record shared by every layer: never changed after construction
