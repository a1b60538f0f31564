"""Where a model chunk first uses its parameters in a forward: how the data-parallel wrapper learns where it
may wait for a parameter all-gather (``parallel.overlap_param_gather``).

With the distributed optimizer (ZeRO-1) each data-parallel rank updates 1/dp of every grad bucket and the
updated values are all-gathered into the params (`mptrain.distributed.param_gather`). Under
``parallel.overlap_param_gather`` that all-gather runs while the next forward has started: the wrapper waits
for a bucket in a forward pre-hook of the first module whose parameters are in it (Megatron's DDP registers
its pre-hook on every module). A pre-hook inside a compiled graph cannot wait on a collective (it is traced
into the graph), so the model names the modules whose pre-hooks run eagerly, in forward order, through
`ParamUseRegions`; the wrapper waits for every other parameter at the chunk's forward.

Implemented by `GPTModel` (the embedding, each layer, the final norm, the output layer; the chunk alone
when its forward is one compiled graph). A user's model without the method: its parameters are waited for
at the chunk's forward (correct, and the all-gather still overlaps what runs before it).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ParamUseRegions(Protocol):
    """A model chunk that names the submodules where its parameters are first used."""

    def param_use_regions(self) -> list:
        """Submodules (the chunk itself allowed) whose forward pre-hooks run eagerly, outside any compiled graph,
        and in whose forward (its submodules' included) the parameters they hold are first used, in the order
        the forward calls them. A parameter held by none of them is waited for before the chunk's forward."""
        ...
