"""The precision options (``precision.name``) and the params dtype each one trains in."""

import torch

from mptrain.errors import ConfigError

# precision.name -> params dtype: the one table of precision options (a closed Megatron choice, --fp16 / --bf16;
# fp8 trains bf16 params and activations, its block GEMMs in FP8: mptrain.layers.fp8)
PARAM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def params_dtype(precision: str) -> torch.dtype:
    """torch dtype of model params for ``precision.name`` (fp32 | bf16 | fp16 | fp8, whose params are bf16).

    Raises:
        ConfigError: unknown precision name.
    """
    if precision not in PARAM_DTYPES:
        raise ConfigError(f"precision: unknown precision={precision!r}; pick one of {', '.join(PARAM_DTYPES)}")
    return getattr(torch, PARAM_DTYPES[precision])
