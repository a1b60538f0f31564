"""Which samples each DP rank reads: Megatron's `MegatronPretrainingSampler`, driven by
`consumed_samples` so a resumed run continues the exact stream.

Micro-step k (counted from `consumed_samples`) covers the samples
[c + k·b·d, c + (k+1)·b·d) (c = consumed_samples, b = micro_batch_size, d = dp_size), and DP
rank r reads its slice [c + k·b·d + r·b, c + k·b·d + (r+1)·b). A global batch of G samples is G /
(b·d) consecutive micro-steps, so global batch i holds samples [i·G, (i+1)·G) whatever b and d:
the data a step sees depends only on the data settings and the iteration (DESIGN.md §3).
Example, G = 8, b = 2, d = 2, c = 0: step 1 → rank 0 reads [0,1] then [4,5]; rank 1 reads [2,3]
then [6,7]; at d = 1, b = 4 one rank reads [0..3] then [4..7] — the same 8 samples.
"""

from __future__ import annotations

from typing import Iterator

from mptrain.errors import ConfigError


class PretrainingSampler:
    """Yields this DP rank's sample indices per micro-step, forever.

    Args:
        micro_batch_size: b, samples per micro-batch per DP rank.
        dp_rank: r in [0, dp_size).
        dp_size: d.
        consumed_samples: samples all DP ranks together have consumed before (a multiple of b·d).
    Raises:
        ConfigError: consumed_samples not a multiple of b·d, or bad sizes.
    """

    def __init__(self, *, micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int = 0) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(
                f"sampler: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size} are inconsistent"
            )
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.consumed_samples = 0
        self.load_state_dict({"consumed_samples": consumed_samples})

    @property
    def step_size(self) -> int:
        """Samples consumed by all DP ranks per micro-step (b·d)."""
        return self.micro_batch_size * self.dp_size

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            first = self.consumed_samples + self.dp_rank * self.micro_batch_size
            self.consumed_samples += self.step_size
            yield list(range(first, first + self.micro_batch_size))

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        consumed = int(state["consumed_samples"])
        if consumed < 0 or consumed % self.step_size:
            raise ConfigError(
                f"consumed_samples={consumed} is not a non-negative multiple of micro_batch_size × dp size = "
                f"{self.step_size}; resume with the global_batch_size the checkpoint was written with"
            )
        self.consumed_samples = consumed
