"""LayerNorm / RMSNorm (torch implementations) with their sharding specs.

Norm params are replicated over TP. Under sequence parallelism each TP rank normalises a
different sequence slice ``[s/tp, b, h]``, so its weight/bias grads are partial sums: their spec
says ``sequence_parallel_grad`` and ``finalize_model_grads`` all-reduces them over TP
(Korthikanti et al. 2022, §4.2.2). Weights start at ones, biases at zeros (layout-independent).
"""

from __future__ import annotations

from typing import Optional

import torch

from mptrain.errors import ConfigError
from mptrain.layers.sharding import ShardSpec


def _norm_specs(module: torch.nn.Module, sequence_parallel: bool) -> dict:
    return {
        name: ShardSpec(global_shape=tuple(p.shape), no_weight_decay=True, sequence_parallel_grad=sequence_parallel)
        for name, p in module.named_parameters(recurse=False)
    }


class LayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm over the last dim h; input/output ``[s(/tp), b, h]``; weight and bias ``[h]``."""

    def __init__(self, hidden_size: int, *, eps: float, sequence_parallel: bool, params_dtype: torch.dtype,
                 device: Optional[torch.device]) -> None:
        super().__init__(hidden_size, eps=eps, device=device, dtype=params_dtype)
        self.sequence_parallel = sequence_parallel

    def local_shard_specs(self) -> dict:
        return _norm_specs(self, self.sequence_parallel)


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm over the last dim h (Zhang & Sennrich 2019); weight ``[h]``, no bias."""

    def __init__(self, hidden_size: int, *, eps: float, sequence_parallel: bool, params_dtype: torch.dtype,
                 device: Optional[torch.device]) -> None:
        super().__init__(hidden_size, eps=eps, device=device, dtype=params_dtype)
        self.sequence_parallel = sequence_parallel

    def local_shard_specs(self) -> dict:
        return _norm_specs(self, self.sequence_parallel)


NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}


def norm_class(name: str):
    """The norm class for ``model.normalization``. Raises ConfigError listing the valid names."""
    try:
        return NORMS[name]
    except KeyError:
        raise ConfigError(f"model: normalization={name!r} is not one of {sorted(NORMS)}; pick one of them") from None


def build_norm(config, *, sequence_parallel: bool, params_dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None) -> torch.nn.Module:
    """``config.normalization`` over ``config.hidden_size`` with ``config.layernorm_epsilon``."""
    return norm_class(config.normalization)(config.hidden_size, eps=config.layernorm_epsilon,
                                            sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                                            device=device)
