"""Point-to-point communication between adjacent pipeline stages (Megatron ``p2p_communication.py``).

Forward direction: activations ``[s(/tp), b, h]`` go from a stage to ``groups.next_pp_rank``.
Backward direction: their grads (same shape) go to ``groups.prev_pp_rank``. Ranks wrap around
(the last rank's "next" is rank 0), which the interleaved schedule uses to pass chunk k's output
on the last rank to chunk k+1 on the first rank.

Every exchange is one `torch.distributed.batch_isend_irecv` over the PP group, waited on before
returning (no ``synchronize()``; on NCCL the wait orders the current stream). Ops are posted in a
fixed order on every rank (forward-direction messages before backward-direction ones), and each
direction has its own tag, so that with pp = 2 — where next and prev are the same rank — an
activation and a grad travelling together between the same pair are never swapped (NCCL matches
per peer in posting order, gloo by tag).

Shapes come from the config (`ScheduleSpec.tensor_shape`), so no shape exchange is needed; receive
buffers are fresh tensors (the received activation is a leaf with ``requires_grad=True`` so its
``.grad`` is the input grad to send back).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from mptrain.groups import ParallelGroups
from mptrain.schedules.common import ScheduleStats

_TAG_FORWARD = 1
_TAG_BACKWARD = 2


@dataclasses.dataclass(frozen=True)
class P2PConfig:
    """What every p2p call needs: the layout, the (fixed) tensor shape and dtype, the stats sink.

    Attributes:
        tensor_shape: ``(s/tp if sequence_parallel else s, micro_batch_size, hidden_size)``.
        dtype: dtype of the activations and their grads (the model's compute dtype).
        stats: where bytes sent are added (key "pp"); None = not counted.
    """

    groups: ParallelGroups
    tensor_shape: tuple
    dtype: torch.dtype
    stats: Optional[ScheduleStats] = None


def _check(tensor: torch.Tensor, cfg: P2PConfig, what: str) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(cfg.tensor_shape) or tensor.dtype != cfg.dtype:
        raise RuntimeError(
            f"p2p: {what} has shape {tuple(tensor.shape)} / {tensor.dtype}, the pipeline expects "
            f"{tuple(cfg.tensor_shape)} / {cfg.dtype} ([s/tp if sequence_parallel else s, micro_batch, hidden])"
        )
    return tensor.detach().contiguous()


def _communicate(
    cfg: P2PConfig,
    *,
    send_next: Optional[torch.Tensor] = None,
    send_prev: Optional[torch.Tensor] = None,
    recv_prev: bool = False,
    recv_next: bool = False,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One batched exchange with the neighbours; returns ``(from_prev, from_next)`` (None where not received).

    ``send_next``: activations for the next stage; ``send_prev``: grads for the previous stage;
    ``recv_prev``: receive activations from the previous stage; ``recv_next``: receive grads from
    the next stage.
    """
    groups = cfg.groups
    group = groups.pp_group
    from_prev = from_next = None
    ops = []
    # forward-direction messages first, then backward-direction ones: the same order on every rank
    if send_next is not None:
        send_next = _check(send_next, cfg, "the activation sent forward")
        ops.append(dist.P2POp(dist.isend, send_next, groups.next_pp_rank, group, _TAG_FORWARD))
    if recv_prev:
        from_prev = torch.empty(cfg.tensor_shape, dtype=cfg.dtype, device=groups.device)
        ops.append(dist.P2POp(dist.irecv, from_prev, groups.prev_pp_rank, group, _TAG_FORWARD))
    if send_prev is not None:
        send_prev = _check(send_prev, cfg, "the grad sent backward")
        ops.append(dist.P2POp(dist.isend, send_prev, groups.prev_pp_rank, group, _TAG_BACKWARD))
    if recv_next:
        from_next = torch.empty(cfg.tensor_shape, dtype=cfg.dtype, device=groups.device)
        ops.append(dist.P2POp(dist.irecv, from_next, groups.next_pp_rank, group, _TAG_BACKWARD))
    if not ops:
        return None, None
    timer = cfg.stats.timers("pipeline-p2p") if cfg.stats is not None and cfg.stats.timers is not None else None
    if timer is not None:
        timer.start()
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    if timer is not None:
        timer.stop()
    if cfg.stats is not None:
        for t in (send_next, send_prev):
            if t is not None:
                cfg.stats.add_bytes_sent("pp", t.numel() * t.element_size())
    if from_prev is not None:
        from_prev.requires_grad_(True)
    return from_prev, from_next


def _is_first(cfg: P2PConfig) -> bool:
    return cfg.groups.pp_rank == 0


def _is_last(cfg: P2PConfig) -> bool:
    return cfg.groups.pp_rank == cfg.groups.pp_size - 1


# --- non-interleaved directions: the physical first / last stage neither receives nor sends there --------

def recv_forward(cfg: P2PConfig) -> Optional[torch.Tensor]:
    """Receive ``[s(/tp), b, h]`` activations from the previous stage (None on the first stage)."""
    if _is_first(cfg):
        return None
    return _communicate(cfg, recv_prev=True)[0]


def send_forward(output_tensor: Optional[torch.Tensor], cfg: P2PConfig) -> None:
    """Send activations to the next stage (nothing on the last stage)."""
    if not _is_last(cfg):
        _communicate(cfg, send_next=output_tensor)


def recv_backward(cfg: P2PConfig) -> Optional[torch.Tensor]:
    """Receive the grad of this stage's output from the next stage (None on the last stage)."""
    if _is_last(cfg):
        return None
    return _communicate(cfg, recv_next=True)[1]


def send_backward(input_tensor_grad: Optional[torch.Tensor], cfg: P2PConfig) -> None:
    """Send the grad of this stage's input to the previous stage (nothing on the first stage)."""
    if not _is_first(cfg):
        _communicate(cfg, send_prev=input_tensor_grad)


def send_forward_recv_backward(output_tensor: Optional[torch.Tensor], cfg: P2PConfig) -> Optional[torch.Tensor]:
    """Send activations forward and receive the grad of an earlier output, in one batch (1F1B steady state)."""
    if _is_last(cfg):
        return None
    return _communicate(cfg, send_next=output_tensor, recv_next=True)[1]


def send_backward_recv_forward(input_tensor_grad: Optional[torch.Tensor], cfg: P2PConfig) -> Optional[torch.Tensor]:
    """Send a grad backward and receive the next micro-batch's activations, in one batch (1F1B steady state)."""
    if _is_first(cfg):
        return None
    return _communicate(cfg, send_prev=input_tensor_grad, recv_prev=True)[0]


# --- interleaved combos: the schedule decides (per virtual stage) what to send and receive -----------------

def send_forward_recv_forward(output_tensor: Optional[torch.Tensor], cfg: P2PConfig, *,
                              recv_prev: bool) -> Optional[torch.Tensor]:
    """Send activations to the next rank (if given) and receive activations from the previous rank (if asked)."""
    return _communicate(cfg, send_next=output_tensor, recv_prev=recv_prev)[0]


def send_backward_recv_backward(input_tensor_grad: Optional[torch.Tensor], cfg: P2PConfig, *,
                                recv_next: bool) -> Optional[torch.Tensor]:
    """Send a grad to the previous rank (if given) and receive a grad from the next rank (if asked)."""
    return _communicate(cfg, send_prev=input_tensor_grad, recv_next=recv_next)[1]


def send_forward_backward_recv_forward_backward(
    output_tensor: Optional[torch.Tensor],
    input_tensor_grad: Optional[torch.Tensor],
    cfg: P2PConfig,
    *,
    recv_prev: bool,
    recv_next: bool,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Both directions at once; returns ``(activations from prev, grad from next)`` (interleaved steady state)."""
    return _communicate(cfg, send_next=output_tensor, send_prev=input_tensor_grad,
                        recv_prev=recv_prev, recv_next=recv_next)


@dataclasses.dataclass
class SingleChunkSetup:
    """What the non-interleaved pipelined schedules (GPipe, 1F1B) start from.

    Attributes:
        chunk: the rank's one model chunk. data_iterator: its iterator (unwrapped from a list).
        cfg: the p2p config (shape from the config, SP-aware). is_last: last pipeline stage.
        stats: the caller's stats, or None for forward-only calls (stats describe training only).
    """

    chunk: torch.nn.Module
    data_iterator: object
    cfg: P2PConfig
    is_last: bool
    stats: Optional[ScheduleStats]


def single_chunk_setup(spec, *, model: list, data_iterator, stats: Optional[ScheduleStats],
                       forward_only: bool) -> SingleChunkSetup:
    """The shared start of `forward_backward_gpipe` and `forward_backward_1f1b` (after validation).

    Args:
        spec: the call's `mptrain.schedules.ScheduleSpec` (groups, ``tensor_shape``, dtype).
    """
    stats = None if forward_only else stats
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]
    groups = spec.groups
    return SingleChunkSetup(
        chunk=model[0],
        data_iterator=data_iterator,
        cfg=P2PConfig(groups=groups, tensor_shape=spec.tensor_shape, dtype=spec.dtype, stats=stats),
        is_last=groups.pp_rank == groups.pp_size - 1,
        stats=stats,
    )
