"""Inductor heuristics for the compiled model chunks: norms over the hidden dim as persistent reductions.

A LayerNorm / RMSNorm forward reduces each token's row of h elements (mean and variance). Inductor
generates a row reduction of up to 1024 elements as a persistent kernel: the row is loaded once into
registers, reduced and normalised there. Above 1024 it generates a looped kernel: one loop over the row
updates a Welford mean and M2 per element (a division each), a second loop reads the row again to
normalise it. Hidden sizes of 2048 and 4096 are common. `PersistentNorms` raises the limit for row
reductions to `PERSISTENT_ROW_REDUCTION_MAX` (a row of that many fp32 values fits in registers). The
persistent kernel sums in another order than the looped one, so results differ from it by rounding.

Installed by `install` when a chunk is compiled on CUDA (`mptrain.layers.compile.apply_compile`):
``torch._inductor.config.inductor_choices_class`` (every thread's Inductor, e.g. the autograd thread that
compiles backward graphs; part of Inductor's cache key) where this torch has that key and nobody else
set it, and the calling thread's handler (``V.set_choices_handler``) in any case. A user's own choices
class is kept.
"""

from __future__ import annotations

from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

PERSISTENT_ROW_REDUCTION_MAX = 4096
"""Largest row (elements) reduced by a persistent kernel: h up to 4096 (gpt_6.7b's width)."""


class PersistentNorms(InductorChoices):
    """Inductor's choices, with inner (row) reductions of up to `PERSISTENT_ROW_REDUCTION_MAX` elements
    persistent (module docstring). Module-level, so that pickling it by reference (cache keys) works."""

    def uuid(self) -> str:
        """This heuristic's part of Inductor's cache key (``inductor_choices_class``'s factory contract)."""
        return f"mptrain.PersistentNorms(max={PERSISTENT_ROW_REDUCTION_MAX})"

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
        if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
            return True
        import torch._inductor.config as inductor_config

        return bool(inductor_config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel,
                                                              PERSISTENT_ROW_REDUCTION_MAX))


def install() -> str:
    """Make `PersistentNorms` Inductor's choices (module docstring); returns what was done, for the log."""
    import torch._inductor.config as inductor_config

    current = getattr(inductor_config, "inductor_choices_class", None)
    if current not in (None, PersistentNorms):
        return "kept the configured Inductor choices class"
    if hasattr(inductor_config, "inductor_choices_class"):
        inductor_config.inductor_choices_class = PersistentNorms
    if not isinstance(V.choices, PersistentNorms):
        V.set_choices_handler(PersistentNorms())
    return f"norms over up to {PERSISTENT_ROW_REDUCTION_MAX} elements as persistent reductions"
