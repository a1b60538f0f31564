"""Aux-loss-free load balancing: the expert-bias update after each step (DeepSeek-V3, Wang et al. 2024 §2;
Megatron-core ``moe_utils.get_updated_expert_bias``, called from ``finalize_model_grads``).

Each `TopKRouter` with ``moe_router_enable_expert_bias`` counts, per micro-batch of a training step, the
tokens it dispatched to each expert (``local_tokens_per_expert``). After the step's backward,
`update_expert_bias` (called by `mptrain.distributed.finalize.finalize_model_grads`) sums the counts over the
ranks that routed other tokens of the same layer (TP under sequence parallelism, DP) and moves every bias by

    b_i += moe_router_bias_update_rate · sign(mean_j c_j − c_i)

(an under-loaded expert's scores rise in the next step's top-k choice), then zeroes the counts. One
all-reduce per group for all of this rank's MoE layers. The bias is fp32 and saved in checkpoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mptrain.layers.moe.router import TopKRouter


def routers_with_expert_bias(model_chunks: list) -> list:
    """The `TopKRouter` modules of ``model_chunks`` (any wrappers) that hold an expert bias, in module order."""
    return [m for chunk in model_chunks for m in chunk.modules()
            if isinstance(m, TopKRouter) and m.expert_bias is not None]


@torch.no_grad()
def update_expert_bias(model_chunks: list, groups) -> None:
    """Sum this step's expert counts over TP (under SP) and DP and step the biases (module docstring).

    Collective over ``groups.tp_group`` / ``groups.dp_group`` when this rank has routers with a bias (every
    rank of those groups holds the same layers, so they agree); nothing otherwise.
    """
    routers = routers_with_expert_bias(model_chunks)
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])  # [layers, E]
    if routers[0].sequence_parallel and groups.tp_size > 1:
        dist.all_reduce(counts, group=groups.tp_group)
    if groups.dp_size > 1:
        dist.all_reduce(counts, group=groups.dp_group)
    rate = routers[0].config.moe_router_bias_update_rate
    step = torch.sign(counts.mean(dim=-1, keepdim=True) - counts) * rate
    for router, delta in zip(routers, step):
        router.expert_bias.add_(delta)
        router.local_tokens_per_expert.zero_()
