"""`GroupedMLP`: the local routed experts of an MoE layer (Megatron-core ``megatron/core/transformer/moe/experts.py``:
``TEGroupedMLP`` / ``SequentialMLP``).

Legend: ``N`` rows grouped expert-major (``tokens_per_expert [E_local]`` rows per local expert), ``h``
hidden, ``f`` = the expert FFN width (``moe_ffn_hidden_size``), ``parts`` = 2 for SwiGLU's fused
[gate; up] fc1 else 1, ``etp`` = expert-tensor-parallel size (``parallel.expert_tensor_parallel_size``).

Weights, a leading local-expert dim (torch's ``[out, in]`` per expert, as Hugging Face's fused
``gate_up_proj [E, 2f, h]`` / ``down_proj [E, h, f]``):

    experts.linear_fc1.weight  [E_local, parts·f/etp, h]   (rank r: [gate_r; up_r], `ShardSpec.interleave`)
    experts.linear_fc2.weight  [E_local, h, f/etp]

Their `ShardSpec` global shapes hold the global expert axis ``[E, ...]`` (checkpoints address it; an
expert-parallel rank's experts start at ``ShardSpec.expert_offset`` on it, so checkpoints reshard over ep) and the
ETP split on dim 1 (fc1) / dim 2 (fc2), as the dense MLP's TP split. With etp = 1 under tp > 1 the experts are
whole on every TP rank, their grads summed over TP (`ShardSpec.sequence_parallel_grad`). Init as the dense MLP's: fc1 N(0, std²), fc2 N(0, std²/(2L)), each expert drawn from its
own name (``...linear_fc1.weight<e>``, Megatron's per-expert names), so it does not depend on the layout.

Math per expert e (Megatron applies the routing weight before fc2; fc2 is linear, so this equals
weighting the expert's output): ``y = (act(x W1ₑᵀ) · p) W2ₑᵀ``, p the row's routing weight.

Kernels: ``moe_grouped_gemm`` runs both GEMMs over all local experts as ``torch._grouped_mm`` (one call
each, offsets = cumsum(tokens_per_expert) on the device: no host sync; through the custom op `grouped_linear`,
which torch.compile traces in any dtype) where this torch has it for the
dtype and the shapes (`grouped_mm_reason`); otherwise one GEMM per expert (the split sizes are read on
the host). Both give the same values (tests/test_moe_layer.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from mptrain.layers.context import LayerContext
from mptrain.layers.mlp import ACTIVATIONS
from mptrain.layers.moe.config import moe_ffn_hidden_size
from mptrain.layers.sharding import ShardSpec, take_shard

GROUPED_MM = "grouped_mm"
LOOP = "loop"


@functools.lru_cache(maxsize=None)
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """None when ``torch._grouped_mm`` runs forward and backward on ``device_type`` in ``dtype`` (a tiny probe,
    once per process and pair); else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        # the first caller may hold grad off (generation, evaluation) while the answer is cached for the process
        with torch.enable_grad(), torch.inference_mode(False):
            x = torch.ones(4, 16, dtype=dtype, device=device_type, requires_grad=True)
            w = torch.ones(2, 16, 16, dtype=dtype, device=device_type, requires_grad=True)
            offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
            y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            y.backward(torch.ones(4, 16, dtype=dtype, device=device_type))
    except (RuntimeError, NotImplementedError) as err:
        return f"torch._grouped_mm does not run on {device_type} in {dtype}: {str(err).splitlines()[0]}"
    return None


def grouped_mm_reason(weights: list, dtype: torch.dtype) -> Optional[str]:
    """None when ``torch._grouped_mm`` can multiply by every weight ``[E, out, in]`` in ``dtype`` on their device;
    else the reason (no such op, the dtype, or rows not 16-byte aligned: its operands' strides must be)."""
    device_type = weights[0].device.type
    why = _grouped_mm_runs(device_type, dtype)
    if why is not None:
        return why
    elem = torch.empty((), dtype=dtype).element_size()
    for w in weights:
        if (w.shape[-1] * elem) % 16 or (w.shape[-2] * elem) % 16:
            return f"an expert weight {tuple(w.shape)} has rows not a multiple of 16 bytes in {dtype}"
    return None


@torch.library.custom_op("mptrain::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, mode: int) -> torch.Tensor:
    """``torch._grouped_mm`` over contiguous operands, groups ending at ``offs [E]`` (int32, on the device):
    mode 0: ``a [N, in]``, ``b [E, out, in]`` -> ``a_e b_eᵀ`` ``[N, out]``; mode 1: ``a [N, out]``, ``b [E, out, in]``
    -> ``a_e b_e`` ``[N, in]``; mode 2: ``a [N, out]``, ``b [N, in]`` -> ``a_eᵀ b_e`` ``[E, out, in]``.
    A custom op so that torch.compile traces it by `_grouped_mm_fake` in every dtype the eager kernel runs (the aten
    op's own fake accepts bf16 only), and the transposes stay inside (no stride change of the weights)."""
    if mode == 0:
        return torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
    if mode == 1:
        return torch._grouped_mm(a, b, offs=offs)
    return torch._grouped_mm(a.t(), b, offs=offs)


@_grouped_mm_op.register_fake
def _grouped_mm_fake(a, b, offs, mode):
    if mode == 0:
        return a.new_empty(a.shape[0], b.shape[1])
    if mode == 1:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[1], b.shape[1])


class GroupedLinear(torch.autograd.Function):
    """``y = x_e w_eᵀ`` per group (x ``[N, in]`` grouped expert-major, w ``[E, out, in]``, offs ``[E]`` int32 group
    ends) -> ``[N, out]``; backward: ``dx = dy_e w_e``, ``dw_e = dy_eᵀ x_e`` (two more grouped GEMMs)."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return _grouped_mm_op(x.contiguous(), w, offs, 0)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()  # strided, not the expanded grad a .sum() gives
        return _grouped_mm_op(grad, w, offs, 1), _grouped_mm_op(grad, x.contiguous(), offs, 2), None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`GroupedLinear`: x ``[N, in]``, w ``[E, out, in]`` (contiguous), offs ``[E]`` int32 -> ``[N, out]``."""
    return GroupedLinear.apply(x, w, offs)


class ExpertWeight(torch.nn.Module):
    """One stacked expert weight ``weight [E_local, out_local, in_local]`` with its `ShardSpec`."""

    def __init__(self, weight: torch.Tensor, spec: ShardSpec) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self._spec = spec

    def local_shard_specs(self) -> dict:
        return {"weight": self._spec}


class GroupedMLP(torch.nn.Module):
    """The local experts (module docstring); the default ``experts`` node of the MoE spec.

    Args:
        config: ModelConfig (hidden_size, moe_ffn_hidden_size / ffn_hidden_size, activation, moe_grouped_gemm,
            num_layers for the scaled init).
        context: `LayerContext` (init, params_dtype, device).
        layer_number: global 0-based layer index (names ``decoder.layers.<n>.mlp.experts.*``).
        num_local_experts: E_local. expert_offset: global index of the first local expert.
        etp_rank, etp_size: this rank's expert-tensor-parallel coordinates.
    forward(x ``[N, h]``, tokens_per_expert ``[E_local]`` int64, probs ``[N]``) -> ``[N, h]`` (with etp > 1 a
    partial sum over the ETP ranks, reduced by the dispatcher's combine).
    Raises:
        ValueError: the expert width not divisible by etp.
    """

    def __init__(self, config, context: LayerContext, *, layer_number: int, num_local_experts: int,
                 expert_offset: int = 0, etp_rank: int = 0, etp_size: int = 1) -> None:
        super().__init__()
        self.act_fn, parts = ACTIVATIONS[config.activation]
        h, f = config.hidden_size, moe_ffn_hidden_size(config)
        if f % etp_size:
            raise ValueError(f"GroupedMLP: expert width {f} is not divisible by the expert-tensor-parallel size {etp_size}")
        f_local, e_global = f // etp_size, config.num_moe_experts
        prefix = f"decoder.layers.{layer_number}.mlp.experts"
        experts = range(expert_offset, expert_offset + num_local_experts)
        fc1_part = ShardSpec((parts * f, h), partition_dim=0, offset=etp_rank * f_local, interleave=parts)
        fc1 = [take_shard(context.init.normal(f"{prefix}.linear_fc1.weight{e}", (parts * f, h)), fc1_part,
                          parts * f_local) for e in experts]
        fc2 = [context.init.normal(f"{prefix}.linear_fc2.weight{e}", (h, f), scaled=True)
               .narrow(1, etp_rank * f_local, f_local) for e in experts]
        sharded = etp_size > 1
        # whole experts on each of several TP ranks (etp = 1 < tp): every rank routed its own sequence shard to
        # them, so their grads are summed over TP as the sequence-parallel norms' (finalize_model_grads)
        summed_over_tp = not sharded and context.sequence_parallel
        # ep > 1: other ranks hold the other experts; grads reduced over expert-data-parallel, not DP
        split = num_local_experts < e_global
        fc1_spec = ShardSpec((e_global, parts * f, h), partition_dim=1 if sharded else None,
                             offset=etp_rank * f_local, interleave=parts if sharded else 1,
                             sequence_parallel_grad=summed_over_tp, expert_parallel=split,
                             expert_offset=expert_offset)
        fc2_spec = ShardSpec((e_global, h, f), partition_dim=2 if sharded else None, offset=etp_rank * f_local,
                             valid=f_local if sharded else None, sequence_parallel_grad=summed_over_tp,
                             expert_parallel=split, expert_offset=expert_offset)
        as_param = dict(device=context.device, dtype=context.params_dtype)
        self.linear_fc1 = ExpertWeight(torch.stack(fc1).to(**as_param), fc1_spec)
        self.linear_fc2 = ExpertWeight(torch.stack(fc2).contiguous().to(**as_param), fc2_spec)
        self.grouped_gemm = bool(config.moe_grouped_gemm)
        self.num_local_experts = num_local_experts
        self._kernels: dict = {}  # (dtype, device type) -> `kernel`'s answer: the weights' shapes never change
        self._prime_kernel()

    def _prime_kernel(self) -> None:
        """Answer `kernel` for the weights' dtype now, outside any trace: a compiled forward then reads the cached
        answer (its probe runs a backward, which torch.compile cannot trace)."""
        if self.linear_fc1.weight.device.type in ("cpu", "cuda"):
            self.kernel()

    def _apply(self, fn, recurse: bool = True):
        """A cast or a move (``Float16Module``'s ``.to(bf16)``) changes `kernel`'s key: answer it again."""
        out = super()._apply(fn, recurse)
        self._prime_kernel()
        return out

    def kernel(self, dtype: Optional[torch.dtype] = None) -> tuple:
        """``(grouped_mm | loop, why)`` for inputs of ``dtype`` (default: the weights'): what forward runs."""
        if not self.grouped_gemm:
            return LOOP, "model.moe_grouped_gemm=false"
        weights = [self.linear_fc1.weight, self.linear_fc2.weight]
        key = (dtype or weights[0].dtype, weights[0].device.type)
        if key not in self._kernels:
            why = grouped_mm_reason(weights, key[0])
            self._kernels[key] = (LOOP, why) if why else (GROUPED_MM, "")
        return self._kernels[key]

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if self.kernel(x.dtype)[0] == GROUPED_MM:
            offs = tokens_per_expert.to(device=x.device).cumsum(0).to(torch.int32)  # group ends, on the device
            h1 = grouped_linear(x, w1, offs)  # [N, parts·f/etp]
            a = (self.act_fn(h1) * probs.unsqueeze(-1)).to(h1.dtype)
            return grouped_linear(a, w2, offs)  # [N, h]
        counts = tokens_per_expert.tolist()  # host read: the split sizes of the per-expert GEMMs
        outs = []
        for e, (xe, pe) in enumerate(zip(x.split(counts), probs.split(counts))):
            a = (self.act_fn(xe @ w1[e].t()) * pe.unsqueeze(-1)).to(x.dtype)
            outs.append(a @ w2[e].t())
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


def describe_experts(model_chunks: list) -> str:
    """`` experts=grouped_mm`` / `` experts=loop (<why>)`` for the start-up ``kernels:`` line: what the
    `GroupedMLP` modules of ``model_chunks`` (any wrappers) run; empty without MoE layers on this rank."""
    kinds = dict.fromkeys(m.kernel() for chunk in model_chunks for m in chunk.modules() if isinstance(m, GroupedMLP))
    return "".join(f" experts={kind}" + (f" ({why})" if why else "") for kind, why in kinds)
