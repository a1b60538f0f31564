"""Where ``torch.compile`` applies to a model chunk: one plan from the config, applied in one place.

The keys (`mptrain.config.model.ModelConfig`): ``compile_layers`` (on / off), ``compile_scope``
(``chunk`` | ``layer``), ``compile_mode`` (``auto`` | null | torch.compile's modes).

* ``chunk``: the chunk's whole forward (embedding, layers, final norm, output layer, cross entropy)
  is one graph, so a micro-batch is one forward and one backward graph launch (torchtitan and a
  plain compiled GPT do the same). It falls back to ``layer`` where the chunk cannot be one graph
  (`chunk_compile_blocker`): activation recomputation, or dropout drawn in the TP RNG fork.
* ``layer``: each layer of the block is compiled in place (its ``compile``; `TransformerLayer`
  compiles its body, so parameter names stay), and the cross entropy's passes one by one (`compile_pass`).

`plan_compile` decides (pure: config, layout, device); `apply_compile` applies the plan to a built
chunk; `compile_reason` says what was compiled, for the start-up log's ``kernels:`` line.
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


def check_compile(model) -> None:
    """``model.compile_scope`` and ``model.compile_mode`` are known options.

    Raises:
        ConfigError: one line naming the key, the value and the options.
    """
    check_choice("model.compile_scope", model.compile_scope, COMPILE_SCOPES)
    check_choice("model.compile_mode", model.compile_mode, COMPILE_MODES)


def chunk_compile_blocker(config, sequence_parallel: bool) -> Optional[str]:
    """Why ``model.compile_scope=chunk`` cannot compile this chunk as one graph (None: it can).

    The chunk graph holds no RNG fork and no recomputation: `RNGStatesTracker.fork` swaps the
    device generator's state (not traceable) and the recompute checkpoint saves and replays it.
    Where either is needed the layers are compiled one by one, as ``compile_scope=layer``.
    """
    if config.recompute_granularity is not None:
        return f"model.recompute_granularity={config.recompute_granularity} (recomputation replays the RNG state)"
    if config.attention_dropout > 0:
        return f"model.attention_dropout={config.attention_dropout} (drawn in the TP RNG fork)"
    if sequence_parallel and config.hidden_dropout > 0:
        return f"model.hidden_dropout={config.hidden_dropout} with sequence parallelism (drawn in the TP RNG fork)"
    return None


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
        compile_layers: ``model.compile_layers`` (nothing is compiled when False).
        chunk: the chunk's forward is one graph (``compile_scope=chunk`` and nothing blocks it).
        mode: the ``torch.compile`` mode of the compiled regions (`compile_mode_for`; None = Inductor's default).
        blocker: why the chunk is not one graph (`chunk_compile_blocker`, or ``model.compile_scope=layer``);
            None when it is.
    """

    compile_layers: bool
    chunk: bool
    mode: Optional[str]
    blocker: Optional[str]

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
    blocker = (chunk_compile_blocker(config, sequence_parallel) if config.compile_scope == "chunk"
               else "model.compile_scope=layer")
    chunk = bool(config.compile_layers) and blocker is None
    return CompilePlan(compile_layers=bool(config.compile_layers), chunk=chunk,
                       mode=compile_mode_for(config, groups, device, chunk), blocker=blocker)


def apply_compile(model: torch.nn.Module, plan: CompilePlan) -> None:
    """Compile the chunk in place as the plan says: its forward as one graph (``model.compile``), or each
    layer of ``model.decoder.layers`` (``layer.compile``: a user's layer without its own ``compile``
    gets ``torch.nn.Module.compile``, its whole call). ``torch.compile`` is lazy: nothing traces here.

    In place, so parameter names and the module tree are unchanged (checkpoints address them by name).
    Layer graphs: Dynamo caches by code object, so every layer reuses the graphs traced for the first
    one (parameters are graph inputs).
    """
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
    """`` compile=chunk (...)`` / `` compile=layer (chunk graph: <why not>)`` for the start-up log's
    ``kernels:`` line, from the chunks' ``compiled_chunk``, ``compile_mode`` and ``compile_blocker``
    (`GPTModel`'s); empty when nothing is compiled or the model provider is a user's without them.

    Args:
        models: the model chunks, unwrapped (no DDP / Float16Module around them).
    """
    if not any(getattr(getattr(m, "config", None), "compile_layers", False) for m in models):
        return ""
    if all(getattr(m, "compiled_chunk", False) for m in models):
        modes = dict.fromkeys(str(getattr(m, "compile_mode", None) or "default") for m in models)
        return f" compile=chunk (one graph per model chunk, mode {', '.join(modes)})"
    blockers = dict.fromkeys(str(getattr(m, "compile_blocker", "")) for m in models)
    return f" compile=layer (chunk graph: {'; '.join(b for b in blockers if b) or 'n/a'})"
