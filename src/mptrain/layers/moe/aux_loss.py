"""The router's auxiliary losses and how their gradient joins the LM loss's.

Losses (Megatron-core ``megatron/core/transformer/moe/moe_utils.py``), per MoE layer and micro-batch,
``T`` tokens routed by this rank, ``E`` experts, top-``k``:

    aux_loss (Switch Transformer, Fedus et al. 2021, eq. 4):
        L_aux = coeff · E · Σ_i f_i · P_i,  f_i = count_i / (T_g · k),  P_i = Σ_t score[t, i] / T_g
    where count_i counts the tokens whose top-k (on the full scores) holds expert i and score is the full
    softmax (or the sigmoid normalised over E). Under sequence parallelism each TP rank routes its own
    sequence shard: count_i is summed over TP and T_g = T · tp, so the ranks' losses sum to the
    micro-batch's (``switch_load_balancing_loss_func``'s derivation). Perfect balance gives L_aux = coeff.
    seq_aux_loss (DeepSeek-V2): the same per sequence (experts × sequences as columns), divided by b.
    z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``coeff / tp · mean_t logsumexp(logits_t)²``.

None of them is added to the LM loss. `MoEAuxLossAutoScaler` attaches a loss to a tensor of the
forward (the routing probs, the logits): identity forward; in backward it passes the tensor's grad
through and gives the loss the grad ``scale``, so the loss is backpropagated as if added to the
loss the schedule backpropagates. That scale is set once per iteration by the trainer
(`set_aux_loss_scale`, from `mptrain.training.step.Trainer.train_step`) to

    scale = loss_scale / (num_microbatches · dp)

Derivation (docs/ARCHITECTURE.md "Loss normalisation"): the schedule backpropagates
``loss_sum · loss_scale / max_tokens`` per micro-batch, DP sums the grads and the optimizer multiplies
them by ``max_tokens / N`` (N the global loss-masked token count): the LM term is the per-token mean of
the global batch, times loss_scale. With ``scale`` above the aux term is the mean of the per-micro-batch
aux losses over the num_microbatches · dp micro-batches of the global batch (Megatron's weighting,
``loss_scale / num_microbatches`` with DP's average), times loss_scale and ``max_tokens / N``, which is 1
when every token counts in the loss (the unmasked pretraining case; masked tokens raise the aux
weight by that ratio).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """``forward(output, aux_loss, scale) -> output``; backward: ``(grad_output, scale · ones_like(aux_loss), None)``.

    Megatron's class of the same name, with the scale a tensor argument (no class attribute): ``scale`` is a
    0-d fp32 tensor the trainer fills in place (`set_aux_loss_scale`), read when backward runs.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss, scale)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.dtype), None


@runtime_checkable
class UsesAuxLossScale(Protocol):
    """A module whose auxiliary losses need the LM loss's backward scale (`TopKRouter`)."""

    def set_aux_loss_scale(self, scale: float) -> None: ...


def set_aux_loss_scale(model: torch.nn.Module, scale: float) -> None:
    """Hand ``scale`` (module docstring: ``loss_scale / (num_microbatches · dp)``) to every module of ``model``
    (any wrapper: its submodules are walked) that implements `UsesAuxLossScale`."""
    for module in model.modules():
        if isinstance(module, UsesAuxLossScale):
            module.set_aux_loss_scale(scale)


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, *, total_tokens: int,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """``coeff · E / (k · T_g²) · Σ_i (Σ_t scores[t, i]) · tokens_per_expert[i]`` (module docstring).

    Args:
        scores: ``[T, C]`` fp32, the full score distribution of this rank's tokens (C = E columns, or b·E for the
            per-sequence loss: one block of E per sequence).
        tokens_per_expert: ``[C]`` counts over the T_g tokens (summed over TP under SP), no grad.
        total_tokens: T_g. num_experts: E.
    Returns:
        0-d fp32 tensor (the per-sequence loss: the sum over sequences).
    """
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff · mean_t logsumexp(logits_t)²`` (ST-MoE eq. 5), in fp32. logits ``[T, E]``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff
