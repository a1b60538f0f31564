"""The transformer MLP: column-parallel fc1 -> activation -> row-parallel fc2 (Shoeybi et al. 2019, §3, Fig. 3a).

Legend: ``[s, b, h]`` activations (``[s/tp, b, h]`` in/out under sequence parallelism); ``f`` =
``ffn_hidden_size`` (default 4h). fc1 weight ``[f, h]`` (gelu) or ``[2f, h]`` = [gate; up]
(swiglu, Shazeer 2020), sharded on dim 0 (swiglu: each of gate and up sharded, so rank r holds
[gate_r; up_r] and ``ShardSpec.interleave = 2``); fc2 weight ``[h, f]`` sharded on dim 1 with
Megatron's scaled init std / sqrt(2L). No communication between fc1 and fc2.

Spec tree (``model.transformer_layer.submodules.mlp``, kind `MLP_KIND`): ``linear_fc1``
(column-parallel), ``activation`` (kind `ACTIVATION`, interface `ActivationFunction`), ``linear_fc2``
(row-parallel). The default activation `Activation` reads ``model.activation`` (gelu | swiglu, the
table `ACTIVATIONS`); a node naming another class (``torch.nn.SiLU``) ignores that key.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from mptrain.components import ComponentKind
from mptrain.config.model import MLPSubmodules
from mptrain.errors import check_choice
from mptrain.layers.context import LayerContext
from mptrain.layers.spec import (COLUMN_PARALLEL_LINEAR, ROW_PARALLEL_LINEAR, build_module, submodule,
                                 with_returned_bias)

KEY = "model.transformer_layer.submodules.mlp"


class ActivationFunction(Protocol):
    """The MLP's nonlinearity between fc1 and fc2.

    Built as ``target(*, config)`` (only if it accepts ``config``; ``torch.nn.GELU`` is built bare).
    ``forward(y [s, b, fc1_parts · f/tp]) -> [s, b, f/tp]``, elementwise within each rank's shard
    (no communication: fc1's output is split on the last dim over TP). ``fc1_parts`` (attribute,
    default 1 when absent): how many f-wide blocks fc1 produces; 2 for a gated unit ([gate_r; up_r]
    on rank r, each block sharded separately, `ShardSpec.interleave`).
    """

    fc1_parts: int

    def __call__(self, y: torch.Tensor) -> torch.Tensor: ...


ACTIVATION = ComponentKind("activation", runtime_keywords=("config",), interface=ActivationFunction)


def _swiglu(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)  # local [gate_r; up_r]
    return F.silu(gate) * up


ACTIVATIONS = {"gelu": (F.gelu, 1), "swiglu": (_swiglu, 2)}
"""``model.activation`` -> (function, fc1 output parts): the one table of that Megatron key."""


def check_activation(model) -> None:
    """``model.activation`` is a built-in name. Raises ConfigError naming the key and the options."""
    check_choice("model.activation", model.activation, tuple(ACTIVATIONS))


class Activation(torch.nn.Module):
    """The default activation node: ``ACTIVATIONS[config.activation]`` (no parameters)."""

    def __init__(self, *, config) -> None:
        super().__init__()
        self.fn, self.fc1_parts = ACTIVATIONS[config.activation]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fn(y)


class MLP(torch.nn.Module):
    """forward(x ``[s(/tp), b, h]``) -> ``[s(/tp), b, h]`` (fc2 bias added).

    Args:
        config: ModelConfig. context: `LayerContext`, handed to both linears.
        layer_number: global 0-based layer index (names the parameters ``decoder.layers.<n>.mlp.*``).
        submodules: the spec node's ``submodules`` (linear_fc1, activation, linear_fc2); None = the default
            `mptrain.config.model.MLPSubmodules`.
        ffn_hidden_size: f; None = ``model.ffn_hidden_size`` (4h when null). prefix: the parameters' global
            name prefix; None = ``decoder.layers.<n>.mlp`` (a subclass such as the MoE shared expert sets both).
        key: the spec node's config key, for messages.
    """

    def __init__(self, config, context: LayerContext, *, layer_number: int, submodules=None,
                 ffn_hidden_size: Optional[int] = None, prefix: Optional[str] = None, key: str = KEY) -> None:
        super().__init__()
        if submodules is None:
            submodules = MLPSubmodules()
        node = {"submodules": submodules}
        act = build_module(f"{key}.submodules.activation", submodule(node, "activation"), ACTIVATION, config=config)
        parts = int(getattr(act, "fc1_parts", 1))  # optional attribute of the interface (1: not gated)
        ffn = ffn_hidden_size or config.ffn_hidden_size or 4 * config.hidden_size
        prefix = prefix or f"decoder.layers.{layer_number}.mlp"
        common = dict(context=context, bias=config.add_bias_linear)
        self.linear_fc1 = build_module(f"{key}.submodules.linear_fc1", submodule(node, "linear_fc1"),
                                       COLUMN_PARALLEL_LINEAR, input_size=config.hidden_size, output_size=parts * ffn,
                                       name=f"{prefix}.linear_fc1", parts=parts, **common)
        self.act = act
        self.linear_fc2 = build_module(f"{key}.submodules.linear_fc2", submodule(node, "linear_fc2"),
                                       ROW_PARALLEL_LINEAR, input_size=ffn, output_size=config.hidden_size,
                                       name=f"{prefix}.linear_fc2", input_is_parallel=True, scaled_init=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = with_returned_bias(self.linear_fc1(x))  # [s, b, parts · f/tp]
        return with_returned_bias(self.linear_fc2(self.act(y)))


MLP_KIND = ComponentKind("MLP", methods=("forward",),
                         runtime_keywords=("config", "context", "layer_number", "submodules"),
                         interface=MLP)
