"""Schema of the `optim` config group: the optimizer and the LR schedule (DESIGN.md §1 "Components").

Both are components (`mptrain.components`): ``optim._target_`` is the optimizer class (built by
`mptrain.optim.builders.build_optimizer_factory`, the runtime passes the param groups) and
``optim.lr_scheduler._target_`` the LR schedule (built by `mptrain.optim.lr_scheduler.build_lr_scheduler`,
the runtime passes the optimizer). The Megatron keys below are mapped onto a target's keywords
only where its signature accepts them; keys a user adds with ``+optim.<key>=...`` go to the
optimizer as they are (checked against its signature at start-up).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

LR_SCHEDULER_TARGET = "mptrain.optim.lr_scheduler.OptimizerParamScheduler"


@dataclasses.dataclass
class LRSchedulerConfig:
    """The LR schedule component. Its Megatron keys live in `optim` (``optim.lr_decay_style``, ...);
    keys a user adds here (``+optim.lr_scheduler.cycle_iters=100``) go to the target as they are."""

    _target_: str = LR_SCHEDULER_TARGET
    """The schedule class (`mptrain.optim.lr_scheduler.LRScheduler` interface); called with ``optimizer=``."""
    _partial_: bool = True


@dataclasses.dataclass
class OptimConfig:
    _target_: str = "torch.optim.Adam"
    """The optimizer class (torch.optim.Optimizer interface), e.g. torch.optim.AdamW or torch.optim.RMSprop
    (conf/optim/*.yaml set it; the default is conf/optim/adam.yaml's)."""
    _partial_: bool = True
    """The runtime passes ``params`` (the weight-decay / no-decay groups of the fp32 main params)."""
    name: str = "adam"
    """The option's label (adam | adamw | sgd for the shipped files), for logs only: `_target_` selects."""
    lr: float = 1e-3
    """Peak learning rate (after warmup), >= 0. Passed as ``lr``."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (<= lr)."""
    decoupled_lr: Optional[float] = None
    """Megatron's --decoupled-lr: peak learning rate of the input embedding and the output layer (the tied weight
    is the embedding; the last stage's copy too), over the same warmup / decay as lr; the other params keep lr.
    null = off (one schedule for every param). metrics.jsonl's lr stays the other params' (the embedding /
    output LR is decoupled_min_lr + c × (decoupled_lr - decoupled_min_lr) for the coefficient c that lr shows)."""
    decoupled_min_lr: Optional[float] = None
    """Megatron's --decoupled-min-lr: the embedding and output layer's learning rate at the end of the decay
    (<= decoupled_lr); null = min_lr. Only with decoupled_lr."""
    weight_decay: float = 0.0
    """Applied to weights only: biases and norm params are in a no-decay group. Passed as ``weight_decay`` (>= 0)."""
    adam_beta1: float = 0.9
    """Passed as ``betas[0]`` (in [0, 1))."""
    adam_beta2: float = 0.999
    """Passed as ``betas[1]`` (in [0, 1))."""
    adam_eps: float = 1e-8
    """Passed as ``eps`` (> 0)."""
    sgd_momentum: float = 0.0
    """Passed as ``momentum``."""
    optimizer_cpu_offload: bool = False
    """Megatron's --optimizer-cpu-offload: the fp32 master params, their grads and the optimizer state live in host
    memory and the optimizer steps there. With parallel.data_parallel_sharding_strategy=optim_grads_params (or
    optim_grads) through FSDP2's CPUOffloadPolicy: the sharded fp32 params are the master weights, copied to
    the device for each layer's all-gather, their reduced grads copied back; it also runs at dp = 1 (ZeRO-3 over
    one rank). Refused with the other strategies."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0 (iteration 1 runs at lr 0 when > 0, as Megatron)."""
    lr_warmup_fraction: Optional[float] = None
    """Megatron's --lr-warmup-fraction, in [0, 1]: warmup = this × lr_decay_iters (× lr_decay_samples when
    training by train.train_samples; the decay length being null: × train.train_iters / train.train_samples,
    Megatron's default decay length). Not a whole number of iterations in general: the LR ramps by
    n / (fraction × length). null = lr_warmup_iters / lr_warmup_samples; set together with either > 0 it is
    an error."""
    lr_warmup_samples: int = 0
    """Megatron's --lr-warmup-samples: samples of linear warmup, with train.train_samples (the schedule then
    counts samples: global_batch_size per applied step). 0 = none; without train.train_samples an error."""
    lr_decay_samples: Optional[int] = None
    """Megatron's --lr-decay-samples: the sample count at which the decay reaches min_lr, with
    train.train_samples (as lr_decay_iters, in samples); null: no decay. Without train.train_samples an error."""
    lr_decay_iters: Optional[int] = None
    """Iteration at which the decay reaches min_lr (warmup included); null: no decay (constant, or
    inverse-square-root without the final cut to min_lr)."""
    lr_decay_style: str = "constant"
    """constant | linear | cosine | inverse-square-root | WSD. Skipped (overflow / non-finite) iterations do not advance the schedule (Megatron)."""
    lr_wsd_decay_iters: Optional[int] = None
    """WSD: iterations of the final decay (the last ones before lr_decay_iters); the stable phase runs at lr before them."""
    lr_wsd_decay_style: str = "exponential"
    """WSD: shape of the final decay: exponential | linear | cosine | minus_sqrt (Megatron's --lr-wsd-decay-style)."""
    impl: str = "auto"
    """auto | torch | apex: for the built-in Adam / AdamW / SGD, apex FusedAdam/FusedSGD when asked for (error if
    not importable), torch fused (CUDA or CPU) otherwise (foreach for params on other or mixed devices). A user
    target gets ``fused`` / ``foreach`` only if its signature accepts them."""
    lr_scheduler: LRSchedulerConfig = dataclasses.field(default_factory=LRSchedulerConfig)
    """The LR schedule component (its own ``_target_``)."""
