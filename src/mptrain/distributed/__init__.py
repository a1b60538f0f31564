"""Data parallelism: contiguous grad buffers, the DDP wrapper, finalize_model_grads, ZeRO-1 optimizer.

Wrapping order: ``DistributedDataParallel(Float16Module(GPTModel))``; after the schedule call
`finalize_model_grads(chunks, groups, num_tokens=..., max_tokens=...)`, then the optimizer's step.
"""

from mptrain.distributed.ddp import DistributedDataParallel
from mptrain.distributed.distrib_optimizer import DistributedOptimizer, ShardEntry
from mptrain.distributed.finalize import finalize_model_grads
from mptrain.distributed.grad_buffer import Bucket, GradBuffer, ParamSlot, default_bucket_size

__all__ = [
    "Bucket",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "GradBuffer",
    "ParamSlot",
    "ShardEntry",
    "default_bucket_size",
    "finalize_model_grads",
]
