"""torchao's float8 pieces behind `mptrain.layers.fp8`: the one module that imports torchao.

Public API (``torchao.float8.__all__``): ``Float8LinearConfig`` (a recipe's casts and GEMM options),
``ScalingType`` and ``ScalingGranularity`` (what a cast config says), ``convert_to_float8_training``. The
latter runs here once, on a one-linear module on the meta device: it applies torchao's Inductor workaround
for compiled fp8 stores (0.18's ``_inductor_patch``; earlier releases have none) before any fp8 kernel
is compiled, and its ``Float8Linear`` builds the GEMM options of the recipe, which every cast here carries.

Not public (torchao: "Float8TrainingTensor and Float8Linear are not public APIs"), and needed because
mptrain makes the casts itself: each amax is MAX-reduced over the TP group before its scale is taken, and
an fp8 operand is saved for backward, or cached once per iteration, as its data and scale, then rebuilt.
`PRIVATE_SYMBOLS` lists each such name; tests/test_fp8_torchao.py checks every one in the installed torchao,
so a release that moves one fails there by name. `TESTED_RELEASES`: the torchao minor releases
tests/test_fp8.py and that test pass with (`mptrain.layers.fp8.check_fp8_installed` refuses others).

Source: torchao ``torchao/float8/`` (``float8_linear.py``'s ``matmul_with_hp_or_float8_args`` makes the
same casts, ``float8_scaling_utils.hp_tensor_to_float8_dynamic`` without the TP group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Optional

import torch

TESTED_RELEASES = ((0, 13), (0, 18))
"""The oldest and the newest torchao minor release (``(major, minor)``) the fp8 tests pass with."""

PRIVATE_SYMBOLS = {
    "torchao.float8.float8_utils": ("tensor_to_amax", "amax_to_scale"),
    "torchao.float8.float8_training_tensor": ("hp_tensor_and_scale_to_float8", "GemmInputRole", "Float8TrainingTensor"),
    "torchao.float8.float8_training_tensor.GemmInputRole": ("INPUT", "WEIGHT", "GRAD_OUTPUT"),
    "torchao.float8.float8_training_tensor.Float8TrainingTensor": ("_data", "_scale"),
    "torchao.float8.float8_linear.Float8Linear": ("linear_mm_config",),
}
"""torchao names outside ``torchao.float8.__all__`` that this module uses: owner (a module, a class) -> the names
read from it (of the two classes: attributes of the instances, an fp8 tensor and a converted linear)."""

POSITIONAL_PARAMETERS = {
    "tensor_to_amax": ("x", "reduce_amax", "device_mesh", "scaling_granularity", "axiswise_dim"),
    "amax_to_scale": ("amax", "float8_dtype", "round_scales_to_power_of_2"),
    "hp_tensor_and_scale_to_float8": ("hp_tensor", "s", "float8_dtype", "linear_mm_config", "gemm_input_role",
                                      "axiswise_dim"),
    "Float8TrainingTensor": ("data", "scale", "orig_dtype", "linear_mm_config", "gemm_input_role", "axiswise_dim"),
}
"""The parameters, in order, of the private callables that this module calls with positional arguments."""


@contextlib.contextmanager
def quiet_import():
    """Importing torchao logs two kinds of noise above a run's first lines, once per process and rank:
    torch >= 2.11 calls its enum registration with pytree deprecated, and torchao warns for each compiled
    extension its wheel has for another Python or GPU (MXFP8, CUTLASS kernels), which the float8 recipes
    here do not use (they call ``torch._scaled_mm``). Both loggers are quiet below ERROR for the import."""
    loggers = [logging.getLogger("torch.utils._pytree"), logging.getLogger("torchao")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


class Float8Ops:
    """torchao's casts, held as plain attributes: a cast inside a compiled graph calls them without an import
    (an import guard there would break the graph). Built by `load`.

    Attributes:
        config: the recipe's ``Float8LinearConfig`` (public; its ``cast_config_*`` say how each GEMM casts).
        input_role / weight_role / grad_output_role: an operand's role in torchao's three GEMMs.
    """

    def __init__(self, recipe: str, emulate: bool) -> None:
        with quiet_import():
            import torchao.float8 as public
            from torchao.float8 import float8_training_tensor as tensors
            from torchao.float8 import float8_utils as utils
        self.config = dataclasses.replace(public.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        self._disabled = public.ScalingType.DISABLED
        self._tensorwise = public.ScalingGranularity.TENSORWISE
        # torchao's own Float8Linear builds the GEMM options (emulation, fast accumulation, padding) of the recipe;
        # converting applies its Inductor workaround too, as for any of its users
        converted = public.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16, device="meta")),
                                                      config=self.config)
        self.mm_config = converted[0].linear_mm_config
        self._tensor_to_amax, self._amax_to_scale = utils.tensor_to_amax, utils.amax_to_scale
        self._to_float8, self._float8_tensor = tensors.hp_tensor_and_scale_to_float8, tensors.Float8TrainingTensor
        roles = tensors.GemmInputRole
        self.input_role, self.weight_role, self.grad_output_role = roles.INPUT, roles.WEIGHT, roles.GRAD_OUTPUT

    def disabled(self, cast_config) -> bool:
        """Whether the recipe keeps this operand in high precision (no cast)."""
        return cast_config.scaling_type is self._disabled

    def tensorwise(self, cast_config) -> bool:
        """One scale per tensor (else one per row along an axis: rowwise)."""
        return cast_config.scaling_granularity is self._tensorwise

    def amax(self, t: torch.Tensor, cast_config, axiswise_dim: Optional[int]) -> torch.Tensor:
        """``max |t|``: ``[]`` tensorwise, else along ``axiswise_dim`` (kept as a dim of 1); this rank's elements."""
        return self._tensor_to_amax(t, False, None, cast_config.scaling_granularity, axiswise_dim)

    def scale(self, amax: torch.Tensor, target_dtype: torch.dtype) -> torch.Tensor:
        """``fp8_max / amax`` in fp32 (amax clamped above 0; power-of-2 rounded where the recipe says)."""
        return self._amax_to_scale(amax, target_dtype, self.config.round_scales_to_power_of_2)

    def to_float8(self, t: torch.Tensor, scale: torch.Tensor, target_dtype: torch.dtype, role: Any,
                  axiswise_dim: Optional[int] = None):
        """``t · scale`` saturated and rounded to ``target_dtype``: torchao's fp8 tensor for its GEMMs (autograd:
        the gradient passes through)."""
        return self._to_float8(t, scale, target_dtype, self.mm_config, role, axiswise_dim)

    def from_parts(self, data: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype, role: Any):
        """The tensorwise fp8 tensor of existing fp8 ``data`` and its ``scale`` (`parts`, a cached cast)."""
        return self._float8_tensor(data, scale, orig_dtype, self.mm_config, role, None)

    @staticmethod
    def parts(t) -> tuple:
        """(fp8 data, fp32 scale) of a tensor `to_float8` made: plain tensors, for ``ctx.save_for_backward``."""
        return t._data, t._scale


@functools.lru_cache(maxsize=None)
def load(recipe: str, emulate: bool) -> Float8Ops:
    """The `Float8Ops` of a recipe (tensorwise | rowwise | rowwise_with_gw_hp), one per process."""
    return Float8Ops(recipe, emulate)
