"""`MoELayer`: the Mixture-of-Experts layer in place of a transformer layer's MLP (Megatron-core
``megatron/core/transformer/moe/moe_layer.py``; Shazeer et al. 2017, Fedus et al. 2021).

Legend: ``[s, b, h]`` in and out (``[s/tp, b, h]`` under sequence parallelism: each TP rank routes its
own sequence shard), ``T = s·b`` tokens, ``E`` experts, top-``k``. The groups' expert grid places the experts:
with ETP = TP > 1 (Megatron's default) each expert's FFN is sharded over the TP ranks and the dispatcher gathers
the ranks' tokens (`mptrain.layers.moe.dispatcher.build_dispatcher`); with ETP = 1 every TP rank holds whole
experts and routes its own sequence shard to them.

    probs, routing_map = router(x)                                  [T, E], [T, E] bool
    rows, tokens_per_expert, row_probs = dispatcher.dispatch(x, probs, routing_map)
      (dropless at ep = etp = 1, a router with ``route`` (`RoutesTopK`): the same rows from the top-k form,
       indices, weights = router.route(x)                           [T, k], [T, k]
       rows, tokens_per_expert, row_probs = dispatcher.dispatch_topk(x, indices, weights))
    y = dispatcher.combine(experts(rows, tokens_per_expert, row_probs))     [T, h]
    y = y + shared_experts(x)                                       (with a shared expert)

Spec tree (``model.transformer_layer.submodules.moe``, kind `MOE_KIND`; used on the layers
``model.moe_layer_freq`` marks, `mptrain.layers.moe.config.is_moe_layer`): ``router`` (kind `ROUTER_KIND`,
default `TopKRouter`), ``experts`` (kind `EXPERTS_KIND`, default `GroupedMLP`), ``shared_experts`` (kind
`mptrain.layers.mlp.MLP_KIND`, default `SharedExpertMLP`, built with ``moe_shared_expert_intermediate_size``).
The token dispatcher is built from ``model.moe_token_dispatcher_type`` and the groups
(`mptrain.layers.moe.dispatcher.build_dispatcher`); any object with the `TokenDispatcher` methods can be
handed in (``token_dispatcher=``). The layer is the transformer layer's ``mlp`` attribute, so its
parameters are ``decoder.layers.<n>.mlp.router.weight``, ``...mlp.experts.linear_fc1.weight``,
``...mlp.shared_experts.linear_fc1.weight``, as Megatron-core names them.

Under ``torch.compile`` the layer is traced with the rest of the graph where its shapes are static
(`mptrain.layers.compile.moe_eager_reason` None: ep = etp = 1 with the `LocalDispatcher`, dropless or padded to
capacity, no sequence parallelism; the grouped GEMMs, whose offsets stay on the device). Elsewhere it runs
eagerly between graphs (``torch.compiler.disable``): its row counts and the collectives' split sizes depend on
the routing, and the per-expert loop reads them on the host.

Profiler regions (``torch.profiler.record_function``, eager runs): ``moe.router``, ``moe.permute``,
``moe.experts``, ``moe.unpermute``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from mptrain.components import ComponentKind
from mptrain.config.model import MoESubmodules
from mptrain.layers.compile import moe_eager_reason
from mptrain.layers.context import LayerContext
from mptrain.layers.mlp import ACTIVATION, MLP_KIND
from mptrain.layers.moe.dispatcher import LocalDispatcher, TokenDispatcher, build_dispatcher
from mptrain.layers.moe.experts import LOOP, GroupedMLP
from mptrain.layers.moe.router import RoutesTopK, TopKRouter
from mptrain.layers.spec import COLUMN_PARALLEL_LINEAR, ROW_PARALLEL_LINEAR, build_module, submodule

KEY = "model.transformer_layer.submodules.moe"

ROUTER_KIND = ComponentKind("MoE router", methods=("forward",), runtime_keywords=("config", "context", "layer_number"),
                            interface=TopKRouter)
"""``router``: ``forward(x [s, b, h]) -> (probs [T, E], routing_map [T, E] bool)`` (see `TopKRouter`)."""
EXPERTS_KIND = ComponentKind(
    "MoE experts", methods=("forward",),
    runtime_keywords=("config", "context", "layer_number", "num_local_experts", "expert_offset", "etp_rank",
                      "etp_size"),
    interface=GroupedMLP)
"""``experts``: ``forward(x [N, h], tokens_per_expert [E_local], probs [N]) -> [N, h]`` (see `GroupedMLP`)."""


def _region(name: str):
    """A ``torch.profiler.record_function`` region in eager runs; nothing inside a trace (Dynamo drops it, with a
    warning)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else torch.profiler.record_function(name)


class MoELayer(torch.nn.Module):
    """forward(x ``[s(/tp), b, h]``) -> ``[s(/tp), b, h]`` (module docstring).

    Args:
        config: ModelConfig (num_moe_experts, moe_*). context: `LayerContext`, handed to every child.
        layer_number: global 0-based layer index.
        submodules: the node's ``submodules`` (router, experts, shared_experts); None = the default
            `mptrain.config.model.MoESubmodules`.
        token_dispatcher: a `TokenDispatcher`; None = `build_dispatcher` from the config and the groups.
    """

    def __init__(self, config, context: LayerContext, *, layer_number: int, submodules=None,
                 token_dispatcher: Optional[TokenDispatcher] = None) -> None:
        super().__init__()
        node = {"submodules": submodules if submodules is not None else MoESubmodules()}
        g = context.groups  # the expert grid: ep_rank holds experts [ep_rank·E_local, (ep_rank+1)·E_local)
        num_local = config.num_moe_experts // g.ep_size
        inner = dict(config=config, context=context, layer_number=layer_number)
        self.router = build_module(f"{KEY}.submodules.router", submodule(node, "router"), ROUTER_KIND, **inner)
        self.experts = build_module(f"{KEY}.submodules.experts", submodule(node, "experts"), EXPERTS_KIND,
                                    num_local_experts=num_local, expert_offset=g.ep_rank * num_local,
                                    etp_rank=g.etp_rank, etp_size=g.etp_size, **inner)
        self.token_dispatcher = token_dispatcher or build_dispatcher(config, g)
        # dropless on one rank: the router's top-k form goes to the dispatcher as is (no [T, E] map in between)
        self.routes_topk = (isinstance(self.router, RoutesTopK) and isinstance(self.token_dispatcher, LocalDispatcher)
                            and self.token_dispatcher.capacity_factor is None)
        # traced by torch.compile only with static shapes (module docstring); a handed-in dispatcher runs eagerly
        self.traceable = (isinstance(self.token_dispatcher, LocalDispatcher)
                          and moe_eager_reason(config, g.ep_size, g.etp_size, context.sequence_parallel) is None)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = build_module(f"{KEY}.submodules.shared_experts", submodule(node, "shared_experts"),
                                               MLP_KIND, **inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the per-expert loop reads its split sizes on the host: eager too (a static `traceable` otherwise)
        if self.traceable and getattr(self.experts, "kernel", lambda dtype=None: (None, ""))(x.dtype)[0] != LOOP:
            return self._forward(x)
        return self._eager_forward(x)

    @torch.compiler.disable
    def _eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        if self.routes_topk:
            with _region("moe.router"):
                indices, weights = self.router.route(x)  # [T, k] each
            with _region("moe.permute"):
                rows, tokens_per_expert, row_probs = self.token_dispatcher.dispatch_topk(x.reshape(-1, h), indices,
                                                                                        weights)
        else:
            with _region("moe.router"):
                probs, routing_map = self.router(x)  # [T, E] each
            with _region("moe.permute"):
                rows, tokens_per_expert, row_probs = self.token_dispatcher.dispatch(x.reshape(-1, h), probs,
                                                                                    routing_map)
        with _region("moe.experts"):
            out = self.experts(rows, tokens_per_expert, row_probs)
        with _region("moe.unpermute"):
            y = self.token_dispatcher.combine(out).view(s, b, h)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


MOE_KIND = ComponentKind("MoE layer", methods=("forward",),
                         runtime_keywords=("config", "context", "layer_number", "submodules"), interface=MoELayer)
"""``model.transformer_layer.submodules.moe``: ``forward(x [s(/tp), b, h]) -> [s(/tp), b, h]``, parameters
named relative to ``decoder.layers.<n>.mlp``."""


def moe_spec_kinds() -> dict:
    """The kinds of the MoE node's tree (nested as the config, `mptrain.layers.transformer.spec_kinds`)."""
    return {"_kind": MOE_KIND, "router": {"_kind": ROUTER_KIND}, "experts": {"_kind": EXPERTS_KIND},
            "shared_experts": {"_kind": MLP_KIND, "linear_fc1": {"_kind": COLUMN_PARALLEL_LINEAR},
                               "activation": {"_kind": ACTIVATION}, "linear_fc2": {"_kind": ROW_PARALLEL_LINEAR}}}
