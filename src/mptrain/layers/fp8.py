"""FP8 GEMMs for the transformer layers' parallel linears (``precision=fp8``), from torchao's float8 building blocks.

Legend: ``T`` tokens of a micro-batch (``s·b``), ``in`` / ``out`` the linear's sizes; a weight is
``[out, in]`` (``[out/tp, in]`` column-parallel, ``[out, in/tp]`` row-parallel, `mptrain.layers.linear`).

The three GEMMs of a linear layer (torchao ``float8_training_tensor.py``'s note)::

    forward      y  = x · Wᵀ        [T, in] · [in, out]     contracts over in
    grad input   dx = dy · W        [T, out] · [out, in]    contracts over out
    grad weight  dW = dyᵀ · x       [out, T] · [T, in]      contracts over T

Each operand is cast to FP8 with a dynamic scale (``scale = fp8_max / amax``; e4m3 for x and W, e5m2
for dy under tensorwise) and the GEMM runs as ``torch._scaled_mm`` (or, with ``emulate``, as the same
scaling and rounding computed in fp32: torchao's ``Float8LinearConfig(emulate=True)``), its output in
the activations' dtype (bf16). What is cast how is torchao's recipe (``Float8LinearConfig.from_recipe_name``):

* ``tensorwise``: one scale per tensor, for all three GEMMs (torchao's default; cuBLAS kernel).
* ``rowwise``: one scale per row along the contraction dim of each GEMM (e4m3 everywhere, power-of-2
  scales; CUTLASS kernel).
* ``rowwise_with_gw_hp``: rowwise for the forward and grad-input GEMMs (the weight tensorwise in
  the latter), the grad-weight GEMM in bf16.

The casts go through torchao's (`mptrain.layers.fp8_torchao`, the one module that imports torchao: its
public ``Float8LinearConfig`` and ``convert_to_float8_training``, and the few internals that casting with a
TP-reduced amax needs, each named by a test); the autograd Function,
the TP communications, sequence parallelism and gradient accumulation fusion stay mptrain's
(`mptrain.layers.linear._LinearWithGradAccumulationAndAsyncCommunication` calls `Fp8Gemms`).

**Every layout computes the scales of tp = 1.** A scale must be the amax over the same elements as
in the unsharded model, else tp = 2 rounds differently from tp = 1 (Megatron-LM's amax-reduction
group fixes the same bug for Transformer Engine). `Fp8Gemms` all-reduces (MAX) an amax over the TP
group exactly where this rank holds a part of those elements:

* tensorwise: the amax of a TP-sharded tensor: the weight (both layers), the row-parallel input
  ``x [T, in/tp]`` and the column-parallel output grad ``dy [T, out/tp]``. The column-parallel input
  is whole on every rank (copied by f, or all-gathered from ``[s/tp, b, h]`` under sequence
  parallelism before the cast), as is the row-parallel output grad (all-reduced by g's backward,
  or all-gathered under sequence parallelism): no reduction.
* rowwise: a row scale is the amax along the GEMM's contraction dim, so it needs a reduction only
  where that dim is TP-sharded: ``in`` of the row-parallel forward (x and W) and ``out`` of the
  column-parallel grad-input GEMM (dy and W); a vector of ``T`` or ``in`` amaxes. The grad-weight
  GEMM contracts over tokens, which are whole on every TP rank: its row scales are local.

Context parallelism splits the tokens of every activation over the CP group (each rank holds 2 of the
sequence's 2·cp chunks), so an activation's amax over tokens is all-reduced (MAX) over CP too: tensorwise,
x and dy always; rowwise, the grad-weight GEMM's x and dy (their contraction dim is the tokens). The weight
is whole on every CP rank. Megatron-LM reduces FP8 amaxes over TP × CP likewise
(``parallel_state.get_amax_reduction_group(with_context_parallel=True)``).

Under tensorwise a linear's weight is cast once per optimizer step (`Fp8WeightCasts`), except under ZeRO-2 /
ZeRO-3, where FSDP2 holds a shard outside the layer's forward and backward: there each GEMM casts the weight FSDP
has just all-gathered (its amax over the whole TP-local weight, MAX-reduced over TP as the cached cast's: the same
scale and bits; `apply_fp8`'s ``cache_weight_casts``). The all-gather moves bf16 (FSDP's ``MixedPrecisionPolicy``),
not FP8.

Sources: torchao ``torchao/float8/float8_linear.py`` (``matmul_with_hp_or_float8_args``, the
casts per GEMM), ``float8_scaling_utils.py``, ``config.py``; Micikevicius et al. 2022, "FP8
Formats for Deep Learning"; Megatron-LM ``megatron/core/fp8_utils.py`` (first / last layers in bf16).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import re
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from mptrain.errors import ConfigError, check_choice
from mptrain.layers import fp8_torchao
from mptrain.layers.mappings import _all_reduce

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""``precision.fp8_recipe``: torchao's ``Float8LinearRecipeName`` values."""
FP8_GEMM_FILTERS = ("auto", "none")
"""``precision.fp8_gemm_filter``: ``auto`` leaves GEMMs too small to gain in bf16 (`gemm_runs_in_fp8`); ``none`` converts all."""
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (sm89) and Hopper (sm90) or newer."""
TORCHAO_PIN = "torchao==0.18.0"
"""The torchao release of the GPU numbers (BENCHMARKS.md); `fp8_torchao.TESTED_RELEASES` are the ones accepted."""


def _torchao_installed() -> bool:
    """Whether torchao can be imported (found, not imported: importing it is left to the first fp8 GEMM)."""
    return importlib.util.find_spec("torchao") is not None


def _torchao_version() -> Optional[str]:
    """The installed torchao's version from its package metadata (None without metadata: a source tree on
    the path, taken as it is)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_fp8_config(precision) -> None:
    """The ``precision.fp8_*`` keys (pure; `mptrain.training.validate.validate_config`).

    The keys are in every precision's schema (the group has one, `mptrain.config.precision.PrecisionConfig`,
    registered as ``precision/base_precision``: one typed node whatever the option file), so Hydra accepts
    them beside any ``precision=``; a value other than the default on a precision other than fp8 would do
    nothing, and is an error rather than silence.

    Raises:
        ConfigError: an ``fp8_*`` key set on a precision other than fp8; unknown ``fp8_recipe`` /
            ``fp8_gemm_filter``, or ``fp8_first_last_layers_bf16`` < 0.
    """
    if precision.name != "fp8":
        for field in dataclasses.fields(Fp8Recipe):  # each Fp8Recipe field is the key precision.fp8_<field>
            value = getattr(precision, f"fp8_{field.name}", field.default)
            if value != field.default:
                raise ConfigError(f"precision.fp8_{field.name}={value} applies only to precision=fp8 (this run: "
                                  f"precision={precision.name}); set precision=fp8, or drop the key")
    check_choice("precision.fp8_recipe", precision.fp8_recipe, FP8_RECIPES)
    check_choice("precision.fp8_gemm_filter", precision.fp8_gemm_filter, FP8_GEMM_FILTERS)
    n = precision.fp8_first_last_layers_bf16
    if n is None or n < 0:
        raise ConfigError(f"precision.fp8_first_last_layers_bf16={n} must be an integer >= 0 (0: every layer in fp8)")


def check_fp8_installed(precision) -> None:
    """``precision=fp8`` needs torchao installed (what a dry run on any machine needs too, `mptrain.check`).

    Raises:
        ConfigError: precision=fp8 and torchao missing, or of a minor release outside
            `fp8_torchao.TESTED_RELEASES`.
    """
    if precision.name != "fp8":
        return
    (lo_major, lo_minor), (hi_major, hi_minor) = fp8_torchao.TESTED_RELEASES
    tested = f"{lo_major}.{lo_minor} to {hi_major}.{hi_minor}"
    if not _torchao_installed():
        raise ConfigError(f"precision=fp8 needs torchao; install it (pip install -e .[fp8]: torchao {tested}; in a "
                          "checkout `make setup` keeps it beside the venv: PYTHONPATH=.venv/fp8-site) or pick precision=bf16")
    found = _torchao_version()
    if found is None:  # a source tree on the path: taken as it is
        return
    release = re.match(r"(\d+)\.(\d+)", found)
    # the few torchao internals used (`fp8_torchao.PRIVATE_SYMBOLS`) may move in a release the tests have not seen
    if release is None or not (fp8_torchao.TESTED_RELEASES[0] <= tuple(map(int, release.groups()))
                               <= fp8_torchao.TESTED_RELEASES[1]):
        raise ConfigError(f"precision=fp8 needs torchao {TORCHAO_PIN.split('==')[1]} or another release from {tested} "
                          f"(those its float8 internals are tested with), found {found}; install it "
                          "(pip install -e .[fp8]) or pick precision=bf16")


def check_fp8_environment(precision, *, cuda: Optional[bool] = None) -> None:
    """What ``precision=fp8`` needs from this machine, checked before any collective.

    Args:
        precision: the precision config node (``name``, ``fp8_emulate``).
        cuda: whether the run computes on CUDA; None = ``torch.cuda.is_available()`` (the trainer's choice,
            `mptrain.groups.init_distributed`).
    Raises:
        ConfigError: torchao missing; a CUDA GPU below sm89 without ``fp8_emulate``; CPU without ``fp8_emulate``.
    """
    if precision.name != "fp8":
        return
    check_fp8_installed(precision)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if precision.fp8_emulate:
        return
    if not cuda:
        raise ConfigError("precision=fp8 on CPU has no FP8 GEMMs; set precision.fp8_emulate=true (torchao's "
                          "emulation, for tests) or pick precision=bf16")
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(f"precision=fp8 needs FP8 tensor cores (sm89 or newer), this GPU is sm{capability[0]}"
                          f"{capability[1]}; pick precision=bf16 (or precision.fp8_emulate=true to test)")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the block linears compute in FP8 (from the ``precision`` node, `fp8_recipe_from`).

    Attributes:
        recipe: tensorwise | rowwise | rowwise_with_gw_hp (`FP8_RECIPES`).
        emulate: torchao's emulation (the same scaling and rounding, GEMMs in fp32): CPU tests.
        gemm_filter: auto | none (`FP8_GEMM_FILTERS`, `gemm_runs_in_fp8`).
        first_last_layers_bf16: the first and the last N layers of the model (global indices) stay bf16.
    """

    recipe: str = "tensorwise"
    emulate: bool = False
    gemm_filter: str = "auto"
    first_last_layers_bf16: int = 0

    def layer_in_fp8(self, layer: int, num_layers: int) -> bool:
        """Whether global layer ``layer`` (0-based) of ``num_layers`` computes in FP8: not one of the first or
        last ``first_last_layers_bf16`` (Megatron-LM's ``--first-last-layers-bf16``)."""
        n = self.first_last_layers_bf16
        return n <= layer < num_layers - n

    def all_layers_bf16_warning(self, num_layers: int) -> Optional[str]:
        """One ``warning:`` line when ``first_last_layers_bf16`` keeps every one of ``num_layers`` layers bf16
        (no block GEMM in FP8), naming the key and its largest useful value; None otherwise."""
        n = self.first_last_layers_bf16
        if not num_layers or 2 * n < num_layers:
            return None
        return (f"warning: precision=fp8 with no FP8 GEMM: precision.fp8_first_last_layers_bf16={n} keeps all "
                f"{num_layers} layers bf16; set it to at most {(num_layers - 1) // 2}, or use precision=bf16")


def fp8_recipe_from(precision) -> Optional[Fp8Recipe]:
    """The `Fp8Recipe` of a ``precision`` config node; None unless ``precision.name`` is fp8."""
    if precision.name != "fp8":
        return None
    return Fp8Recipe(recipe=precision.fp8_recipe, emulate=bool(precision.fp8_emulate),
                     gemm_filter=precision.fp8_gemm_filter,
                     first_last_layers_bf16=int(precision.fp8_first_last_layers_bf16))


IN_FP8 = "fp8"
BELOW_SIZE_RULE = "below_size_rule"
LOCAL_DIMS_NOT_16 = "local_dims_not_multiple_of_16"
"""`fp8_gemm_decision`'s outcomes: the GEMM computes in FP8; the size rule keeps it bf16; its weight dims on
this rank are not multiples of 16 (``_scaled_mm`` needs them), so it computes in bf16."""


def fp8_gemm_decision(recipe: Fp8Recipe, *, global_shape: tuple, local_shape: tuple) -> str:
    """The size rule for a linear of weight shape ``[out, in]``: `IN_FP8`, `BELOW_SIZE_RULE` or `LOCAL_DIMS_NOT_16`.

    With ``gemm_filter=auto`` the thresholds of torchao's ``_auto_filter_for_recipe``
    (``float8_linear_utils.py``: below them the casts cost more than the FP8 GEMM saves; restated here, as
    the planner decides without torchao, and checked against torchao's by tests/test_fp8_torchao.py) apply
    to the global shape, so every layout decides alike: tensorwise skips ``in <= 4096 and out <= 1024``; rowwise
    skips ``out <= 2048``, ``in <= 1024`` and ``out <= 4096 and in <= 2048``. Then ``_scaled_mm`` needs both
    local dims (after tensor parallelism) to be multiples of 16; where a TP shard breaks that, this layout
    computes that GEMM in bf16 where tp = 1 would not (`Fp8Summary.warning` says so), also under emulation,
    which decides as the GPU would.
    """
    n, k = global_shape
    if recipe.gemm_filter == "auto":
        small = (k <= 4096 and n <= 1024) if recipe.recipe == "tensorwise" else (
            n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
        if small:
            return BELOW_SIZE_RULE
    if any(d % 16 for d in local_shape):
        return LOCAL_DIMS_NOT_16
    return IN_FP8


def gemm_runs_in_fp8(recipe: Fp8Recipe, *, global_shape: tuple, local_shape: tuple) -> bool:
    """Whether `fp8_gemm_decision` puts this GEMM in FP8."""
    return fp8_gemm_decision(recipe, global_shape=global_shape, local_shape=local_shape) == IN_FP8


class Fp8Gemms:
    """The three GEMMs of one TP linear in FP8, with the amax reductions that make every layout equal tp = 1.

    Args:
        recipe: the `Fp8Recipe`.
        amax_group: the TP group (None when tp = 1: nothing is sharded).
        input_sharded: the contraction dim ``in`` is split over TP (row-parallel).
        output_sharded: ``out`` is split over TP (column-parallel).
        token_group: the CP group, over which the tokens of x and dy are split (None when cp = 1).
    The weight is TP-sharded whenever there is an ``amax_group``.
    """

    def __init__(self, recipe: Fp8Recipe, *, amax_group: Any, input_sharded: bool, output_sharded: bool,
                 token_group: Any = None) -> None:
        self.recipe = recipe
        self.token_group = token_group
        # held, not looked up per cast: an import inside the compiled graph would break it
        self._ao = fp8_torchao.load(recipe.recipe, recipe.emulate)
        self.config = self._ao.config
        self.amax_group = amax_group
        self.input_sharded, self.output_sharded = input_sharded, output_sharded
        c = self.config
        # an operand cast alike in forward and backward is cast once (tensorwise: one scale per tensor)
        self.reuse_input = self._same_cast(c.cast_config_input, c.cast_config_input_for_grad_weight)
        self.reuse_weight = self._same_cast(c.cast_config_weight, c.cast_config_weight_for_grad_input)
        self.reuse_grad_output = self._same_cast(c.cast_config_grad_output, c.cast_config_grad_output_for_grad_weight)

    def _same_cast(self, a, b) -> bool:
        return a == b and not self._ao.disabled(a) and self._ao.tensorwise(a)

    def _cast(self, t: torch.Tensor, cast_config, role, axis: int, *, tensor_sharded: bool, k_sharded: bool,
              column_amax: bool = False, tokens: bool = False):
        """``t`` as a Float8TrainingTensor (or ``t`` itself when the recipe keeps it in high precision).

        ``axis``: the contraction dim of ``t`` in its GEMM (rowwise scales are amaxes along it);
        ``tensor_sharded`` / ``k_sharded``: whether ``t`` / that dim is split over TP (the module docstring);
        ``column_amax``: a tensorwise amax of a 2-D ``t`` taken as the max of its column amaxes (`cast_grad_output`);
        ``tokens``: ``t`` is an activation ``[T, ...]``, its tokens split over `token_group` under CP.
        """
        ao = self._ao
        if ao.disabled(cast_config):
            return t
        tensorwise = ao.tensorwise(cast_config)
        axiswise_dim = None if tensorwise else axis
        if tensorwise and column_amax and t.dim() == 2:
            amax = torch.amax(torch.abs(t), dim=0).max().float()  # the same value: max is exact in any order
        else:
            amax = ao.amax(t, cast_config, axiswise_dim).float()
        if self.amax_group is not None and (tensor_sharded if tensorwise else k_sharded):
            amax = _all_reduce(amax, self.amax_group, "max")  # the amax of the whole logical tensor / row
        # CP: a tensorwise amax, or a row amax along the tokens (axis 0), spans the other CP ranks' tokens too
        if self.token_group is not None and tokens and (tensorwise or axis == 0):
            amax = _all_reduce(amax, self.token_group, "max")
        return ao.to_float8(t, ao.scale(amax, cast_config.target_dtype), cast_config.target_dtype, role, axiswise_dim)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, weight_cast: Optional["Fp8WeightCast"] = None) -> tuple:
        """``y = x · Wᵀ``: x ``[T, in(/tp)]`` (bf16), weight ``[out(/tp), in(/tp)]`` -> (y ``[T, out(/tp)]``
        in x's dtype, the tensors backward needs: a tuple for ``ctx.save_for_backward``).

        ``weight_cast``: the weight's cast made once this optimizer step (`Fp8WeightCast`, tensorwise): used as
        it is, so neither GEMM casts the weight (the same bits as casting it here)."""
        c, ao = self.config, self._ao
        sharded_w = self.amax_group is not None
        x8 = self._cast(x, c.cast_config_input, ao.input_role, -1, tensor_sharded=self.input_sharded,
                        k_sharded=self.input_sharded, tokens=True)
        # saved as plain tensors: the fp8 input where backward reuses its cast (1 byte an element instead of 2)
        x_saved = ao.parts(x8) if self.reuse_input else (x, None)
        if weight_cast is not None:
            w8_t = ao.from_parts(weight_cast.data.t(), weight_cast.scale, weight.dtype, ao.weight_role)  # [in, out]
            return torch.mm(x8, w8_t), (*x_saved, None, weight_cast.scale, weight_cast.grad_input_operand())
        w8_t = self._cast(weight.t(), c.cast_config_weight, ao.weight_role, 0, tensor_sharded=sharded_w,
                          k_sharded=self.input_sharded)  # [in, out]
        y = torch.mm(x8, w8_t)
        # of the weight's cast only the scale (backward recasts with it: the same bits, no amax pass and no
        # reduction, and no fp8 copy of the weight held per micro-batch in flight)
        return y, (*x_saved, weight, ao.parts(w8_t)[1] if self.reuse_weight else None, None)

    def cast_grad_output(self, grad_output: torch.Tensor, *, with_bias_grad: bool = False):
        """dy ``[T, out(/tp)]`` cast for the grad-input GEMM (its amax TP-reduced where ``out`` is sharded);
        under tensorwise the grad-weight GEMM reuses it.

        ``with_bias_grad``: the caller also sums dy over tokens (the bias grad). The tensorwise amax is then taken
        over tokens first (``[out]`` column amaxes, then their max: the same value), a reduction over the same
        dim as the bias grad's, so that Inductor computes both in one pass over dy (at the MLP's fc1 that pass
        also recomputes GeLU's backward) instead of two."""
        return self._cast(grad_output, self.config.cast_config_grad_output, self._ao.grad_output_role, -1,
                          tensor_sharded=self.output_sharded, k_sharded=self.output_sharded,
                          column_amax=with_bias_grad, tokens=True)

    def grad_input(self, dy8, saved: tuple) -> torch.Tensor:
        """dx ``[T, in(/tp)]`` = dy · W from `cast_grad_output`'s dy and `forward`'s saved tensors; a
        partial sum over TP for a column-parallel layer (the caller reduces it)."""
        ao, (_, _, weight, w_scale, w8_cached) = self._ao, saved
        if w8_cached is not None:  # [out, in]: the cached cast (`Fp8WeightCast.grad_input_operand`)
            # dy8's dtype is its high-precision one (an fp8 tensor wraps its data as the dtype it was cast from)
            return torch.mm(dy8, ao.from_parts(w8_cached, w_scale, dy8.dtype, ao.weight_role))
        if self.reuse_weight:
            target = self.config.cast_config_weight.target_dtype
            w8_t = ao.to_float8(weight.t(), w_scale, target, ao.weight_role)
        else:
            w8_t = self._cast(weight.t(), self.config.cast_config_weight_for_grad_input, ao.weight_role, -1,
                              tensor_sharded=self.amax_group is not None, k_sharded=self.output_sharded)
        return torch.mm(dy8, w8_t.t())

    def grad_weight(self, grad_output: torch.Tensor, dy8, saved: tuple) -> torch.Tensor:
        """dW ``[out(/tp), in(/tp)]`` = dyᵀ · x in the activations' dtype. Contracts over tokens, whole on
        every TP rank: rowwise scales need no reduction, and tensorwise reuses the forward's casts."""
        c, ao = self.config, self._ao
        x_or_data, x_scale = saved[0], saved[1]
        dy_gw = dy8 if self.reuse_grad_output else self._cast(
            grad_output, c.cast_config_grad_output_for_grad_weight, ao.grad_output_role, 0,
            tensor_sharded=self.output_sharded, k_sharded=False, tokens=True)
        if self.reuse_input:
            x_gw = ao.from_parts(x_or_data, x_scale, grad_output.dtype, ao.input_role)
        else:
            x_gw = self._cast(x_or_data, c.cast_config_input_for_grad_weight, ao.input_role, 0,
                              tensor_sharded=self.input_sharded, k_sharded=False, tokens=True)
        return torch.mm(dy_gw.t(), x_gw)


class Fp8WeightCast:
    """The tensorwise FP8 cast of one linear's weight, made once per optimizer step (`Fp8WeightCasts`) instead of
    in every micro-batch's forward and backward (Transformer Engine caches its FP8 weights the same way).

    Attributes:
        data: ``[out(/tp), in(/tp)]`` e4m3, the forward GEMM's operand (as ``data.t()``, column-major).
        data_t: ``[in, out]`` e4m3, row-major: the grad-input GEMM's column-major operand (``data_t.t()``),
            made once instead of one transposing copy per micro-batch; None under emulation, whose fp32 GEMM
            reads ``data`` (the layout the uncached path gives it).
        scale: ``[]`` fp32, ``fp8_max / amax`` of the whole logical weight (TP-reduced).
        current: set while the trainer holds the casts current (`Fp8WeightCasts.cached`); a linear uses the
            cast only then, so a forward outside (a test, user code after an update) casts as before.
    On CUDA the tensors are marked static (CUDA graphs read them in place; `Fp8WeightCasts.refresh` writes
    them in place). None under ZeRO-2 / ZeRO-3 (the weight is a shard outside the forward, module docstring).
    """

    def __init__(self, weight: torch.Tensor, target_dtype: torch.dtype, *, emulate: bool) -> None:
        kwargs = {"dtype": target_dtype, "device": weight.device}
        self.data = torch.empty(tuple(weight.shape), **kwargs)
        self.data_t = None if emulate else torch.empty(tuple(weight.shape)[::-1], **kwargs)
        self.scale = torch.ones((), dtype=torch.float32, device=weight.device)
        self.current = False
        if weight.is_cuda:
            for t in (self.data, self.data_t, self.scale):
                if t is not None:
                    torch._dynamo.mark_static_address(t)

    @classmethod
    def for_linear(cls, gemms: Fp8Gemms, weight: torch.Tensor) -> Optional["Fp8WeightCast"]:
        """A cast for a linear computing through ``gemms``, or None where its recipe casts the weight differently
        in the forward and grad-input GEMMs (rowwise: per-row scales along a different dim in each)."""
        if not gemms.reuse_weight:
            return None
        return cls(weight, gemms.config.cast_config_weight.target_dtype, emulate=gemms.recipe.emulate)

    def grad_input_operand(self) -> torch.Tensor:
        """``[out, in]`` e4m3: the weight operand of ``dx = dy · W``."""
        return self.data if self.data_t is None else self.data_t.t()


def _weight_amax(weight: torch.Tensor) -> torch.Tensor:
    return torch.max(torch.abs(weight))  # torchao's tensor_to_amax (tensorwise)


def _write_weight_cast(weight: torch.Tensor, scale: torch.Tensor, data: torch.Tensor,
                       data_t: Optional[torch.Tensor]) -> None:
    # torchao's _ToFloat8ConstrFunc: fp32 upcast, scale, saturate, round to fp8
    bits = (weight.to(torch.float32) * scale).clamp(-torch.finfo(data.dtype).max, torch.finfo(data.dtype).max)
    bits = bits.to(data.dtype)
    data.copy_(bits)
    if data_t is not None:
        data_t.copy_(bits.t())


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


class Fp8WeightCasts:
    """The `Fp8WeightCast`s of a model's linears, refreshed together (the trainer's, `mptrain.training.step`).

    `refresh` recomputes every cast from the current weights: one amax per weight, one all-reduce (MAX) over
    the TP group of all their amaxes at once (every layout's scales are those of tp = 1, module docstring),
    one cast per weight writing ``data`` / ``data_t`` / ``scale`` in place; on CUDA the amax and the cast
    are compiled (one kernel each). The result is bitwise the cast each GEMM would make (same amax, same
    scale, same rounding); the weights must not change while the casts are `cached`.

    Args:
        linears: modules with ``weight`` and a non-None ``fp8_weight_cast`` and ``fp8`` (`Fp8Gemms`).
    Raises:
        ValueError: the linears reduce their amaxes over different groups.
    """

    def __init__(self, linears: list) -> None:
        self._linears = list(linears)
        groups = {id(m.fp8.amax_group): m.fp8.amax_group for m in self._linears}
        if len(groups) > 1:
            raise ValueError("Fp8WeightCasts: the linears' FP8 amaxes reduce over different groups")
        self._group = next(iter(groups.values()), None)

    def __len__(self) -> int:
        return len(self._linears)

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast every weight as it is now (collective over TP when tp > 1: every TP rank calls it)."""
        if not self._linears:
            return
        weights = [m.weight for m in self._linears]
        on_cuda = weights[0].is_cuda
        amax_fn, cast_fn = (_compiled(_weight_amax), _compiled(_write_weight_cast)) if on_cuda else (
            _weight_amax, _write_weight_cast)
        amax = torch.stack([amax_fn(w) for w in weights]).float()  # [n]
        if self._group is not None:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self._group)
        first = self._linears[0].fp8
        scales = first._ao.scale(amax, first.config.cast_config_weight.target_dtype)  # [n] fp32
        for i, m in enumerate(self._linears):
            cast = m.fp8_weight_cast
            cast.scale.copy_(scales[i])
            cast_fn(m.weight, cast.scale, cast.data, cast.data_t)

    @contextlib.contextmanager
    def cached(self):
        """Within: the linears use their casts, refreshed on entry (call it where the weights are settled for
        the forwards inside: a training iteration's forward-backward, an evaluation)."""
        self.refresh()
        for m in self._linears:
            m.fp8_weight_cast.current = True
        try:
            yield
        finally:
            for m in self._linears:
                m.fp8_weight_cast.current = False


@functools.lru_cache(maxsize=64)
def fp8_gemms(recipe: Fp8Recipe, *, amax_group: Any, input_sharded: bool, output_sharded: bool,
              token_group: Any = None) -> Fp8Gemms:
    """One shared `Fp8Gemms` per (recipe, groups, sharding): every layer's linear of a kind holds the same
    object, so the graphs ``torch.compile`` traces for one layer (its guards on the object) serve all."""
    return Fp8Gemms(recipe, amax_group=amax_group, input_sharded=input_sharded, output_sharded=output_sharded,
                    token_group=token_group)


@runtime_checkable
class UsesFp8(Protocol):
    """A layer whose GEMMs may run in FP8: `apply_fp8` calls ``enable_fp8(recipe)``, which returns
    `fp8_gemm_decision`'s outcome (`IN_FP8` when the layer now computes in FP8; the size rule or its
    local dims may keep it in bf16); ``fp8_decision(recipe)`` is that outcome without enabling anything
    (asked of the first / last bf16 layers, so the summary sees a TP shard that breaks FP8 on any stage);
    ``cache_weight_cast`` False: the layer keeps no `Fp8WeightCast` (`apply_fp8`'s ``cache_weight_casts``).
    Implemented by `mptrain.layers.linear.ColumnParallelLinear` / ``RowParallelLinear``."""

    def fp8_decision(self, recipe: Fp8Recipe) -> str: ...

    def enable_fp8(self, recipe: Fp8Recipe, *, cache_weight_cast: bool = True) -> str: ...


@dataclasses.dataclass
class Fp8Summary:
    """What `apply_fp8` converted on this rank (for the start-up log, `describe`)."""

    recipe: Fp8Recipe
    fp8: int = 0
    below_size_rule: int = 0
    local_dims_not_16: int = 0  # kept bf16: weight dims on this rank not multiples of 16 (`LOCAL_DIMS_NOT_16`)
    shard_breaks_fp8: bool = False  # some block linear of this rank, bf16 layers included, is `LOCAL_DIMS_NOT_16`
    bf16_layers: list = dataclasses.field(default_factory=list)
    in_bf16_layers: int = 0  # the block linears of `bf16_layers` (kept bf16 by first_last_layers_bf16)
    num_layers: int = 0  # model.num_layers (global)
    weight_casts: Optional[Fp8WeightCasts] = None  # the FP8 linears' cached weight casts (tensorwise)
    cast_after_gather: bool = False  # ZeRO-2 / ZeRO-3: no cached casts, each GEMM casts the weight FSDP gathered

    def describe(self) -> str:
        """`` precision=fp8 (tensorwise: 8 of 16 block linears in FP8 ...; bf16: ...)``, for the ``kernels:`` line;
        the total counts every block linear on this rank, those of the bf16 layers included."""
        r = self.recipe
        kept = [f"{self.below_size_rule} below the size rule (precision.fp8_gemm_filter={r.gemm_filter})"]
        if self.local_dims_not_16:
            kept.append(f"{self.local_dims_not_16} with weight dims on this rank not multiples of 16")
        if self.bf16_layers:
            kept.append(f"layers {', '.join(map(str, self.bf16_layers))} (precision.fp8_first_last_layers_bf16="
                        f"{r.first_last_layers_bf16})")
        total = self.fp8 + self.below_size_rule + self.local_dims_not_16 + self.in_bf16_layers
        cached = "; weights cast to FP8 once per iteration" if self.weight_casts else ""
        if self.cast_after_gather and self.fp8:
            cached = "; weights cast to FP8 in each GEMM after FSDP's per-layer all-gather (ZeRO-2 / ZeRO-3)"
        # rowwise_with_gw_hp: the weight-grad GEMM stays bf16 (torchao's recipe)
        gemms = "2 of 3 GEMMs each, the weight grad's in bf16" if r.recipe == "rowwise_with_gw_hp" else "3 GEMMs each"
        return (f" precision=fp8 ({r.recipe}{', emulated' if r.emulate else ''}: {self.fp8} of {total} block linears "
                f"({gemms}) in FP8 on this rank{cached}; bf16: embeddings, output layer, {', '.join(kept)}; MFU is "
                "relative to the bf16 dense peak)")

    def warning(self) -> Optional[str]:
        """One ``warning:`` line when no block GEMM of the model runs in FP8, naming the key that caused it,
        or when the size rule would put a GEMM in FP8 but its weight dims on this rank are not multiples of
        16; None otherwise. Decided for the whole model, not this rank alone: every layer has the same
        shapes, and a rank whose layers are all first/last bf16 layers warns only when every layer of the
        model is one (2 × first_last_layers_bf16 >= num_layers)."""
        r = self.recipe
        all_bf16 = r.all_layers_bf16_warning(self.num_layers)
        if self.fp8 == 0 and all_bf16:
            return all_bf16
        if self.shard_breaks_fp8:  # the only cause that depends on the layout: say it even when others run in FP8
            return ("warning: precision=fp8: block linears whose weight dims after tensor parallelism are not "
                    "multiples of 16, as FP8 GEMMs need, compute in bf16 (the kernels: line counts them); make "
                    "model.hidden_size and model.ffn_hidden_size multiples of 16 x parallel.tensor_model_parallel_size"
                    " (and the QKV width), or use precision=bf16")
        if self.fp8 > 0 or self.below_size_rule == 0:
            return None  # something runs in FP8, or this rank holds no block linear to judge by
        return (f"warning: precision=fp8 with no FP8 GEMM: every block linear is below the size rule "
                f"(precision.fp8_gemm_filter={r.gemm_filter}); set precision.fp8_gemm_filter=none, or use precision=bf16")


def apply_fp8(models: list, recipe: Optional[Fp8Recipe], *, num_layers: int,
              cache_weight_casts: bool = True) -> Optional[Fp8Summary]:
    """Turn on FP8 in the transformer layers of these model chunks (in place; before the first forward).

    Every module under ``model.decoder.layers[<global n>]`` that implements `UsesFp8` gets
    ``enable_fp8(recipe)``, except in the first and last ``recipe.first_last_layers_bf16`` layers of the
    model (Megatron-LM's ``--first-last-layers-bf16``). Embeddings and the output layer are never
    converted. Parameters, names and checkpoints are unchanged: FP8 is a compute mode. The converted
    modules that hold an ``fp8_weight_cast`` (`Fp8WeightCast`) are gathered in the summary's
    ``weight_casts`` (`Fp8WeightCasts`), which the trainer refreshes once per iteration.

    Args:
        models: model chunks, unwrapped (`GPTModel`s; a user's chunk without ``decoder.layers`` is left alone).
        recipe: the `Fp8Recipe`, or None (nothing to do; returns None).
        num_layers: ``model.num_layers`` (the global layer count).
        cache_weight_casts: False where a weight is whole only inside its layer's forward and backward (ZeRO-2 /
            ZeRO-3: FSDP2 all-gathers each layer there and keeps a shard outside, which a cast once per
            iteration cannot read): no `Fp8WeightCast`, each FP8 GEMM casts the gathered weight (torchao's
            ``Float8Linear`` under FSDP2 does the same). Its amax is the whole TP-local weight's, TP-reduced as
            the cached cast's, so both give the same bits; only the cast is made per micro-batch.
    """
    if recipe is None:
        return None
    # torchao's convert_to_float8_training (inside `load`) applies its workaround before any fp8 kernel is compiled:
    # Inductor's min/max codegen in its tl.where form (numerically the same), which a Triton bug needs to store
    # transposed fp8 correctly (torchao 0.18's _inductor_patch.py, triton-lang/triton#11111)
    fp8_torchao.load(recipe.recipe, recipe.emulate)
    summary = Fp8Summary(recipe, num_layers=num_layers, cast_after_gather=not cache_weight_casts)
    for model in models:
        layers = getattr(getattr(model, "decoder", None), "layers", None)
        if layers is None:
            continue
        for key, layer in layers.items():
            if not recipe.layer_in_fp8(int(key), num_layers):
                summary.bf16_layers.append(int(key))
                users = [m for m in layer.modules() if isinstance(m, UsesFp8)]
                summary.in_bf16_layers += len(users)
                # a stage of bf16 layers alone still reports a TP shard that breaks FP8 (rank 0 logs the warning)
                summary.shard_breaks_fp8 |= any(m.fp8_decision(recipe) == LOCAL_DIMS_NOT_16 for m in users)
                continue
            for module in layer.modules():
                if isinstance(module, UsesFp8):
                    decision = module.enable_fp8(recipe, cache_weight_cast=cache_weight_casts)
                    summary.fp8 += decision == IN_FP8
                    summary.below_size_rule += decision == BELOW_SIZE_RULE
                    summary.local_dims_not_16 += decision == LOCAL_DIMS_NOT_16
                    summary.shard_breaks_fp8 |= decision == LOCAL_DIMS_NOT_16
    summary.bf16_layers.sort()
    summary.weight_casts = Fp8WeightCasts([m for model in models for m in model.modules()
                                           if getattr(m, "fp8_weight_cast", None) is not None])
    return summary
