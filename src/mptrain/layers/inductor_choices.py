"""Inductor heuristics for the compiled model chunks: row reductions up to 2048 elements persistent.

A LayerNorm / RMSNorm forward reduces each token's row of h elements (mean and variance). Inductor
generates a row reduction of up to 1024 elements as a persistent kernel: the row is loaded once into
registers, reduced and normalised there. Above 1024 it generates a looped kernel: one loop over the row
updates a Welford mean and M2 per element (a division each), a second loop reads the row again to
normalise it. `PersistentNorms` raises the limit for every row (inner) reduction to
`PERSISTENT_ROW_REDUCTION_MAX`: the norms over h, and any other row of that length (e.g. the unfused
attention core's softmax rows at s <= 2048). The persistent kernel sums in another
order than the looped one, so results differ from it by rounding. bench/reports holds the measurement
(LayerNorm forward at h = 2048).

`install` runs where layers are compiled on CUDA (`mptrain.layers.compile.apply_compile`; the CPU's
C++ code generation does not consult the rule). It sets ``torch._inductor.config.inductor_choices_class``,
which every thread's Inductor builds its handler from (the autograd thread compiles the backward graphs;
from torch 2.13 the class's ``uuid`` is part of Inductor's cache key), and replaces the calling thread's
handler when that is Inductor's plain default. A choices class or handler of your own, set before the
model is built, is kept.
"""

from __future__ import annotations

from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

PERSISTENT_ROW_REDUCTION_MAX = 2048
"""Largest row (elements) reduced by a persistent kernel: h = 2048, where it was measured faster. Wider rows
(h = 2560, 4096) hold more registers per thread and stay with Inductor's looped kernel until measured."""


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
    """Make `PersistentNorms` Inductor's choices (module docstring); returns what was done (tests read it)."""
    import torch._inductor.config as inductor_config

    current = getattr(inductor_config, "inductor_choices_class", None)
    if current not in (None, PersistentNorms) or type(V.choices) not in (InductorChoices, PersistentNorms):
        return "kept the configured Inductor choices"
    if hasattr(inductor_config, "inductor_choices_class"):
        inductor_config.inductor_choices_class = PersistentNorms
    if type(V.choices) is InductorChoices:  # this thread's default, built before the config named ours
        V.set_choices_handler(PersistentNorms())
    return f"row reductions of up to {PERSISTENT_ROW_REDUCTION_MAX} elements as persistent kernels"
