"""The transformer MLP: column-parallel fc1 -> activation -> row-parallel fc2 (Shoeybi et al. 2019, §3, Fig. 3a).

Legend: ``[s, b, h]`` activations (``[s/tp, b, h]`` in/out under sequence parallelism); ``f`` =
``ffn_hidden_size`` (default 4h). fc1 weight ``[f, h]`` (gelu) or ``[2f, h]`` = [gate; up]
(swiglu, Shazeer 2020), sharded on dim 0 (swiglu: each of gate and up sharded, so rank r holds
[gate_r; up_r] and ``ShardSpec.interleave = 2``); fc2 weight ``[h, f]`` sharded on dim 1 with
Megatron's scaled init std / sqrt(2L). No communication between fc1 and fc2.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mptrain.errors import ConfigError
from mptrain.layers.linear import ColumnParallelLinear, RowParallelLinear
from mptrain.layers.random import ParamInit


def _swiglu(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)  # local [gate_r; up_r]
    return F.silu(gate) * up


ACTIVATIONS = {"gelu": (F.gelu, 1), "swiglu": (_swiglu, 2)}  # name -> (fn, fc1 output parts)


def activation(name: str):
    """(fn, parts) for ``model.activation``. Raises ConfigError listing the valid names."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"model: activation={name!r} is not one of {sorted(ACTIVATIONS)}; pick one of them") from None


class MLP(torch.nn.Module):
    """forward(x ``[s(/tp), b, h]``) -> ``[s(/tp), b, h]`` (fc2 bias added)."""

    def __init__(self, config, groups, *, layer_number: int, init: ParamInit, sequence_parallel: bool,
                 params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None,
                 async_grad_allreduce: bool = True, wgrad_transpose: bool = False) -> None:
        super().__init__()
        self.act, parts = activation(config.activation)
        ffn = config.ffn_hidden_size or 4 * config.hidden_size
        prefix = f"decoder.layers.{layer_number}.mlp"
        common = dict(groups=groups, init=init, bias=config.add_bias_linear, sequence_parallel=sequence_parallel,
                      params_dtype=params_dtype, device=device, wgrad_transpose=wgrad_transpose)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, parts * ffn, name=f"{prefix}.linear_fc1", parts=parts,
                                               async_grad_allreduce=async_grad_allreduce, **common)
        self.linear_fc2 = RowParallelLinear(ffn, config.hidden_size, name=f"{prefix}.linear_fc2", input_is_parallel=True,
                                            scaled_init=True, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.linear_fc1(x)  # [s, b, parts · f/tp]
        out, _ = self.linear_fc2(self.act(y))
        return out
