"""Where ``torch.compile`` applies to a model chunk: one plan from the config, applied in one place.

The keys (`mptrain.config.model.ModelConfig`): ``compile_layers`` (null = on for CUDA devices, eager
elsewhere; true / false force it), ``compile_scope`` (``chunk`` | ``layer``), ``compile_mode`` (``auto`` |
null | torch.compile's modes).

* ``chunk``: the chunk's whole forward (embedding, layers, final norm, output layer, cross entropy)
  is one graph, so a micro-batch is one forward and one backward graph launch (torchtitan and a
  plain compiled GPT do the same). Dropout is drawn inside the graph (`mptrain.layers.random`, "Dropout in a
  compiled chunk") and activation recomputation is a recomputed region of it (`mptrain.layers.random.checkpoint`).
  It falls back to ``layer`` where the chunk cannot be one graph (`chunk_compile_blocker`: MoE layers that
  run eagerly).
* MoE layers (`mptrain.layers.moe.MoELayer`) compile with the rest where their shapes are static
  (`moe_eager_reason` None: one rank holds every expert (ep = etp = 1), dropless or padded to capacity, grouped
  GEMMs, no sequence parallelism): the router's top-k is a sort, the permutation an argsort, the grouped GEMMs' offsets a
  device cumsum, so nothing is read on the host. Elsewhere they run eagerly under either scope
  (``torch.compiler.disable``, `MOE_EAGER`): the rows their token dispatch sends and the split sizes of its
  collectives depend on the routing (host integers under expert parallelism or a capacity factor without
  padding), and under sequence parallelism the router sums its counts over TP with in-place collectives.
  The ``kernels:`` line says which, and why.
* ``layer``: each layer of the block is compiled in place (its ``compile``; `TransformerLayer`
  compiles its body, so parameter names stay), and the cross entropy's passes one by one (`compile_pass`).

`plan_compile` decides (pure: config, layout, device); `apply_compile` applies the plan to a built
chunk; `compile_reason` says what was compiled and why, for the start-up log's ``kernels:`` line;
`compile_seconds` reads torch's compile-time counters (the first step's compile time in the log).

Compile time: the chunk's shapes are static (micro-batch and sequence length are fixed by the config,
evaluation uses the same shapes), so nothing is marked dynamic and one graph serves the whole run
(evaluation adds one: module docstring of `mptrain.layers.gpt`). Inductor's FX-graph cache and
AOTAutograd's cache (on by default in torch) make a second run of the same shape load the compiled
kernels instead of generating them.
Source: torchtitan ``torchtitan/distributed/compile.py::apply_compile`` (per-block compile, in place).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from mptrain.errors import check_choice

COMPILE_SCOPES = ("chunk", "layer")
"""``model.compile_scope``: one graph per model chunk, or one per TransformerLayer (`ModelConfig.compile_scope`)."""
COMPILE_MODES = ("auto", None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``model.compile_mode``: ``auto``, null (Inductor's default) and torch.compile's modes."""
MOE_EAGER = "MoE layers run eagerly between graphs"
"""What the ``kernels:`` line says of a compiled MoE model whose MoE layers cannot be traced, before the reason
(`moe_eager_reason`)."""
MOE_COMPILED = "MoE layers in the graph (ep = etp = 1, static token counts)"
"""What the ``kernels:`` line says of a compiled MoE model whose MoE layers compile with the rest."""


def moe_eager_reason(config, ep_size: int = 1, etp_size: int = 1, sequence_parallel: bool = False) -> Optional[str]:
    """Why the MoE layers of ``config`` must run eagerly (module docstring); None when they compile (or there are
    none). ``ep_size`` / ``etp_size``: the groups' expert grid; ``sequence_parallel``: the effective one."""
    if getattr(config, "num_moe_experts", None) is None:
        return None
    if ep_size * etp_size > 1:
        return "expert parallelism: the token dispatch's split sizes depend on the routing"
    if config.moe_expert_capacity_factor is not None and not config.moe_pad_expert_input_to_capacity:
        return "a capacity factor without padding: the kept rows depend on the routing"
    if not config.moe_grouped_gemm:
        return "model.moe_grouped_gemm=false: the per-expert loop reads its split sizes on the host"
    if sequence_parallel:
        return "sequence parallelism: the router sums its counts over TP with in-place collectives"
    return None


def check_compile(model) -> None:
    """``model.compile_scope`` and ``model.compile_mode`` are known options.

    Raises:
        ConfigError: one line naming the key, the value and the options.
    """
    check_choice("model.compile_scope", model.compile_scope, COMPILE_SCOPES)
    check_choice("model.compile_mode", model.compile_mode, COMPILE_MODES)


def resolve_compile_layers(config, device: torch.device) -> tuple[bool, str]:
    """Whether ``model.compile_layers`` compiles on ``device``, and why (for the ``kernels:`` line).

    null (the default): compile on CUDA, where the fused kernels and one graph launch per micro-batch
    pay for the compile time within the first iterations; eager elsewhere (on CPU, Inductor's C++
    compile takes longer than short CPU runs and the eager kernels are already fused where it counts).
    """
    if config.compile_layers is None:
        on = torch.device(device).type == "cuda"
        return on, ("default on CUDA; model.compile_layers=false for eager" if on
                    else f"default: eager on {torch.device(device).type}; model.compile_layers=true compiles")
    return bool(config.compile_layers), f"model.compile_layers={str(bool(config.compile_layers)).lower()}"


def chunk_compile_blocker(config, sequence_parallel: bool, ep_size: int = 1, etp_size: int = 1) -> Optional[str]:
    """Why ``model.compile_scope=chunk`` cannot compile this chunk as one graph (None: it can); the layers are
    then compiled one by one, as ``compile_scope=layer``, and the ``kernels:`` line gives the reason.

    Dense models: nothing blocks it. Dropout is drawn in the graph from the current generator, TP-region masks
    as slices of whole-tensor masks (`mptrain.layers.random.dropout_slice`), so no RNG fork is needed; and
    activation recomputation (full or selective) is torch's checkpoint inside the graph
    (`mptrain.layers.random.checkpoint`), not the eager checkpoint that swaps generator states on the host.
    MoE layers that run eagerly (`moe_eager_reason`) make a model with them not one graph.
    ``config``, ``sequence_parallel`` (the effective one), ``ep_size`` / ``etp_size`` (the expert grid): what a
    rule reads.
    """
    return eager_regions(config, ep_size, etp_size, sequence_parallel)


def eager_regions(config, ep_size: int = 1, etp_size: int = 1, sequence_parallel: bool = False) -> Optional[str]:
    """What runs eagerly inside the compiled regions of a model of ``config``, and why (`MOE_EAGER` and
    `moe_eager_reason` for a model with MoE layers that cannot be traced); None when everything compiles."""
    why = moe_eager_reason(config, ep_size, etp_size, sequence_parallel)
    return f"{MOE_EAGER} ({why})" if why else None


def compile_mode_for(config, groups, device: Optional[torch.device], chunk: bool) -> Optional[str]:
    """The ``torch.compile`` mode of a model chunk's graph (``chunk``) or of a layer's graph:
    ``model.compile_mode``, with ``auto`` resolved to ``reduce-overhead`` (CUDA graphs) for a chunk
    graph on CUDA at tp = pp = 1, else None (Inductor's default). Why only there: with pp > 1 several
    micro-batches' outputs are alive at once (1F1B), and at tp > 1 the graph holds NCCL collectives;
    CUDA graphs pay off where the host is the bottleneck, which is the small single-GPU model."""
    if config.compile_mode != "auto":
        return config.compile_mode
    single = groups.tp_size == 1 and groups.pp_size == 1
    return "reduce-overhead" if chunk and device.type == "cuda" and single else None


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    """What `apply_compile` does to one model chunk.

    Attributes:
        compile_layers: ``model.compile_layers`` resolved for the device (nothing is compiled when False).
        chunk: the chunk's forward is one graph (``compile_scope=chunk`` and nothing blocks it).
        mode: the ``torch.compile`` mode of the compiled regions (`compile_mode_for`; None = Inductor's default).
        blocker: why the chunk is not one graph (`chunk_compile_blocker`, or ``model.compile_scope=layer``);
            None when it is.
        why: why ``compile_layers`` is on or off (`resolve_compile_layers`).
        cuda: the chunk lives on a CUDA device (Inductor generates Triton kernels: `apply_compile` installs
            `mptrain.layers.inductor_choices` there).
        eager: what runs eagerly inside the compiled regions, and why (`eager_regions`); None when compiling
            nothing or everything.
        moe: `MOE_COMPILED` when compiled MoE layers are part of the graphs; else None.
    """

    compile_layers: bool
    chunk: bool
    mode: Optional[str]
    blocker: Optional[str]
    why: str = ""
    cuda: bool = False
    eager: Optional[str] = None
    moe: Optional[str] = None

    @property
    def fused_cross_entropy(self) -> bool:
        """The cross entropy's compiled three-pass variant (`vocab_parallel_cross_entropy`'s ``fused``)."""
        return self.compile_layers

    @property
    def cross_entropy_inplace_backward(self) -> bool:
        """The fused cross entropy writes its grad over the logits (an eager peak-memory saving); inside
        the chunk graph Inductor plans the buffers itself."""
        return not self.chunk


def plan_compile(config, groups, device: torch.device, sequence_parallel: bool) -> CompilePlan:
    """The compile plan of one chunk (pure). ``sequence_parallel``: the effective one (tp > 1)."""
    compile_layers, why = resolve_compile_layers(config, device)
    grid = (getattr(groups, "ep_size", 1), getattr(groups, "etp_size", 1))
    blocker = (chunk_compile_blocker(config, sequence_parallel, *grid) if config.compile_scope == "chunk"
               else "model.compile_scope=layer")
    if blocker is None and getattr(groups, "cp_size", 1) > 1:
        # the CP attention's K/V exchanges run eagerly (`mptrain.layers.cp_attention`): a graph break in each layer
        blocker = "context parallelism: the CP attention runs eagerly between graphs"
    chunk = compile_layers and blocker is None
    return CompilePlan(compile_layers=compile_layers, chunk=chunk,
                       mode=compile_mode_for(config, groups, device, chunk), blocker=blocker, why=why,
                       cuda=torch.device(device).type == "cuda",
                       eager=eager_regions(config, *grid, sequence_parallel) if compile_layers else None,
                       moe=MOE_COMPILED if compile_layers and getattr(config, "num_moe_experts", None) is not None
                       and moe_eager_reason(config, *grid, sequence_parallel) is None else None)


def apply_compile(model: torch.nn.Module, plan: CompilePlan) -> None:
    """Compile the chunk in place as the plan says: its forward as one graph (``model.compile``), or each
    layer of ``model.decoder.layers`` (``layer.compile``: a user's layer without its own ``compile``
    gets ``torch.nn.Module.compile``, its whole call). ``torch.compile`` is lazy: nothing traces here.

    In place, so parameter names and the module tree are unchanged (checkpoints address them by name).
    Layer graphs: Dynamo caches by code object, so every layer reuses the graphs traced for the first
    one (parameters are graph inputs). On CUDA, Inductor's heuristics are `mptrain.layers.inductor_choices`'s
    (the CPU's C++ code generation does not consult them).
    """
    if plan.compile_layers and plan.cuda:
        from mptrain.layers import inductor_choices

        inductor_choices.install()
    if plan.chunk:
        model.compile(mode=plan.mode)
    elif plan.compile_layers:
        for layer in model.decoder.layers.values():
            layer.compile(mode=plan.mode)


@functools.lru_cache(maxsize=None)
def _compiled_pass(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def compile_pass(fn: Callable) -> Callable:
    """One ``torch.compile`` wrapper per pure function (Inductor fuses it into one or two kernels),
    cached; the plain function when already compiling (inside a compiled model chunk)."""
    return fn if torch.compiler.is_compiling() else _compiled_pass(fn)


def compile_reason(models) -> str:
    """`` compile=chunk (...)`` / `` compile=layer (chunk graph: <why not>[; <what runs eagerly>])`` /
    `` compile=off (<why>)`` for
    the start-up log's ``kernels:`` line, from the chunks' ``compile_plan`` (`GPTModel`'s: what was chosen
    and why); a user's provider without a plan: from ``config.compile_layers`` and the chunks'
    ``compiled_chunk``, ``compile_mode``, ``compile_blocker``; empty when that says nothing is compiled.

    Args:
        models: the model chunks, unwrapped (no DDP / Float16Module around them).
    """
    plans = [getattr(m, "compile_plan", None) for m in models]
    whys = "; ".join(dict.fromkeys(p.why for p in plans if isinstance(p, CompilePlan) and p.why))
    why = f"; {whys}" if whys else ""
    if all(isinstance(p, CompilePlan) for p in plans) and plans:
        if not any(p.compile_layers for p in plans):
            return f" compile=off ({whys})" if whys else ""
    elif not any(getattr(getattr(m, "config", None), "compile_layers", False) for m in models):
        return ""
    moes = "".join(f"; {n}" for n in dict.fromkeys(p.moe for p in plans if isinstance(p, CompilePlan) and p.moe))
    if all(getattr(m, "compiled_chunk", False) for m in models):
        modes = dict.fromkeys(str(getattr(m, "compile_mode", None) or "default") for m in models)
        return f" compile=chunk (one graph per model chunk, mode {', '.join(modes)}{moes}{why})"
    # the chunk graph's blockers, then what runs eagerly inside the layer graphs (said once)
    notes = dict.fromkeys([str(getattr(m, "compile_blocker", "")) for m in models]
                          + [p.eager for p in plans if isinstance(p, CompilePlan) and p.eager])
    return f" compile=layer (chunk graph: {'; '.join(b for b in notes if b) or 'n/a'}{moes}{why})"


def compile_seconds() -> float:
    """Seconds this process spent compiling so far (Dynamo's frame compiles, forward and backward graphs,
    Inductor's code generation), from torch's counters (``torch._dynamo.utils.calculate_time_spent``);
    0.0 when torch has none (nothing compiled, or a torch without the counters)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        spent = calculate_time_spent()
    except Exception:  # noqa: BLE001 - a private counter: its absence only drops a log figure
        return 0.0
    return float(spent.get("entire_frame_compile", 0.0)) + float(spent.get("entire_backward_compile", 0.0))
