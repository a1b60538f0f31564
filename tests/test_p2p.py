"""schedules/p2p.py on gloo: every direction delivers the right tensor to the right neighbour, bytes are counted."""

import torch

from harness import run_distributed
from mptrain.groups import build_groups
from mptrain.schedules import p2p
from mptrain.schedules.common import ScheduleStats

SHAPE = (4, 2, 3)  # [s, b, h]


def _value(src: int, kind: float) -> torch.Tensor:
    """A tensor that names its sender and its kind (activation 1000 / grad 2000)."""
    return torch.full(SHAPE, kind + src) + torch.arange(24.0).view(SHAPE)


def _directions(rank, world):
    groups = build_groups(1, world)
    try:
        stats = ScheduleStats()
        cfg = p2p.P2PConfig(groups=groups, tensor_shape=SHAPE, dtype=torch.float32, stats=stats)
        first, last = groups.pp_rank == 0, groups.pp_rank == world - 1
        out = {}
        # forward chain: each stage sends its activation, the next one receives it
        if first:
            p2p.send_forward(_value(rank, 1000.0), cfg)
        elif last:
            out["fwd"] = p2p.recv_forward(cfg)
        else:
            out["fwd"] = p2p.recv_forward(cfg)
            p2p.send_forward(_value(rank, 1000.0), cfg)
        if first:
            assert p2p.recv_forward(cfg) is None  # the first stage receives no activations (no communication)
        if last:
            assert p2p.recv_backward(cfg) is None  # nor the last stage grads
        # backward chain
        if last:
            p2p.send_backward(_value(rank, 2000.0), cfg)
        elif first:
            out["bwd"] = p2p.recv_backward(cfg)
        else:
            out["bwd"] = p2p.recv_backward(cfg)
            p2p.send_backward(_value(rank, 2000.0), cfg)
        # both directions at once (the interleaved steady state): with pp = 2 next == prev, so a swap would show
        got_prev, got_next = p2p.send_forward_backward_recv_forward_backward(
            _value(rank, 1000.0), _value(rank, 2000.0), cfg, recv_prev=True, recv_next=True)
        out["both_prev"], out["both_next"] = got_prev, got_next
        out["requires_grad"] = got_prev.requires_grad
        return out, dict(stats.bytes_sent), groups.prev_pp_rank, groups.next_pp_rank
    finally:
        groups.destroy()


def _check(results, world):
    nbytes = 24 * 4
    for rank, (out, sent, prev, nxt) in enumerate(results):
        if rank > 0:
            torch.testing.assert_close(out["fwd"], _value(rank - 1, 1000.0), rtol=0, atol=0)  # exact copy
        if rank < world - 1:
            torch.testing.assert_close(out["bwd"], _value(rank + 1, 2000.0), rtol=0, atol=0)
        torch.testing.assert_close(out["both_prev"], _value(prev, 1000.0), rtol=0, atol=0)
        torch.testing.assert_close(out["both_next"], _value(nxt, 2000.0), rtol=0, atol=0)
        assert out["requires_grad"]
        chain_sends = (rank < world - 1) + (rank > 0)  # one activation forward, one grad backward
        assert sent == {"pp": nbytes * (chain_sends + 2)}, (rank, sent)


def test_p2p_world2():
    _check(run_distributed(_directions, 2), 2)


def test_p2p_world4():
    _check(run_distributed(_directions, 4), 4)


def _wrong_shape(rank, world):
    groups = build_groups(1, world)
    try:
        cfg = p2p.P2PConfig(groups=groups, tensor_shape=SHAPE, dtype=torch.float32)
        if rank == 0:
            try:
                p2p.send_forward(torch.zeros(4, 2, 5), cfg)
            except RuntimeError as e:
                return str(e)
        return None
    finally:
        # rank 0 leaves without a collective: wait for rank 1 to finish connecting its groups first (destroying them
        # while its last gloo handshake runs closed the pair under load: "Connection closed by peer")
        torch.distributed.barrier()
        groups.destroy()


def test_wrong_shape_is_reported_before_sending():
    msg = run_distributed(_wrong_shape, 2)[0]
    assert "shape (4, 2, 5)" in msg and "expects (4, 2, 3)" in msg
