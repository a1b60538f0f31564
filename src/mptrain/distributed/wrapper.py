"""What a data-parallel wrapper of a model chunk passes through to the chunk it wraps (``self.module``)."""

from __future__ import annotations

import torch


class ChunkWrapper(torch.nn.Module):
    """Base of the data-parallel wrappers (`mptrain.distributed.ddp.DistributedDataParallel`,
    `mptrain.distributed.fsdp.FullyShardedDataParallel`): the pipeline's input tensor goes to the wrapped chunk,
    and the state dict is the chunk's own, without a ``module.`` prefix, so checkpoints address the same names
    under every strategy (Megatron's ``megatron/core/distributed/distributed_data_parallel.py`` does the same).
    A subclass sets ``self.module`` in its ``__init__``."""

    module: torch.nn.Module

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def state_dict(self, *args, **kwargs):
        """The wrapped chunk's state dict (under ZeRO-2 / ZeRO-3: FSDP's DTensor shards)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)

    def release(self) -> None:
        """At the end of a run: drop what ties the chunk's params to this wrapper outside Python's view (nothing
        here; `DistributedDataParallel` removes its grad hooks)."""
