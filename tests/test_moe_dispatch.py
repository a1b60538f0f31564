"""Expert-parallel token dispatchers and their collectives vs one process (gloo, world 2 and 4, fp32).

Each rank routes its own tokens (top-2 of 8 experts, one token with one expert left as capacity dropping
leaves it; uneven token counts per rank, a rank that sends nothing to some EP ranks, an expert that
receives no token anywhere). The stand-in experts multiply
each row by a per-global-expert scale and by its routing prob; under expert tensor parallelism ETP
rank t returns the share w_t of that (shares 1/4 and 3/4: a partial sum that combine must reduce).
dispatch -> experts -> combine must equal the same math on this rank's tokens in one process, bit for
bit, forward and backward. Every value is a small dyadic rational (hidden in steps of 1/8, probs and
grads of 1/16 and 1/4), so every product and sum is exact in fp32: the summation orders, which differ
between the dispatchers and layouts, cannot change a bit, and any misrouted row does.
"""

import torch
import torch.distributed as dist

from harness import run_distributed
from mptrain.groups import build_groups
from mptrain.layers.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mptrain.layers.moe.dispatch_ep import AllGatherDispatcher, AllToAllDispatcher

E, K, H = 8, 2, 6
SCALE = [1.0 + 0.25 * e for e in range(E)]
TOKENS = [5, 3, 7, 1]  # per rank (all-to-all); the all-gather dispatcher needs one T per group: 4
NEVER = E - 1  # no rank routes to this expert


def _rank_data(rank: int, num_tokens: int):
    """Rank `rank`'s hidden [T, H] (column 0: a token id), probs [T, E] (zero off the top-2), routing map."""
    g = torch.Generator().manual_seed(1000 + rank)
    hidden = torch.randint(-32, 33, (num_tokens, H), generator=g).float() / 8
    hidden[:, 0] = rank * 100 + torch.arange(num_tokens, dtype=torch.float32)
    allowed = list(range(E // 2)) if rank == 0 else [e for e in range(E) if e != NEVER]
    scores = torch.rand(num_tokens, E, generator=g)
    scores[:, [e for e in range(E) if e not in allowed]] = -1.0
    routing = torch.zeros(num_tokens, E, dtype=torch.bool).scatter_(1, scores.topk(K, dim=1).indices, True)
    routing[0, scores[0].argmax()] = False  # token 0 keeps one expert (as after capacity dropping)
    probs = torch.where(routing, torch.randint(1, 17, (num_tokens, E), generator=g).float() / 16, torch.zeros(()))
    return hidden, probs, routing


def _reference(hidden, probs, routing):
    """The layer's math in one process: sum over a token's experts of scale_e · prob · x."""
    out = torch.zeros_like(hidden)
    for e in range(E):
        y = (hidden * SCALE[e]) * probs[:, e:e + 1]
        out = out + torch.where(routing[:, e:e + 1], y, torch.zeros(()))
    return out


ETP_SHARES = {1: [1.0], 2: [0.25, 0.75]}


def _experts(rows, tokens_per_expert, row_probs, first_expert, groups):
    """Stand-in experts: rows of local expert i times scale[first + i] times their prob; ETP rank t's share of it."""
    sizes = tokens_per_expert.tolist()
    share = ETP_SHARES[groups.etp_size][groups.etp_rank]
    outs = [((x * SCALE[first_expert + i]) * p.unsqueeze(1)) * share
            for i, (x, p) in enumerate(zip(rows.split(sizes), row_probs.split(sizes)))]
    return torch.cat(outs)


def _check_dispatch(groups, cls, num_tokens_of):
    rank = dist.get_rank()
    hidden, probs, routing = _rank_data(rank, num_tokens_of(rank))
    hidden.requires_grad_(True)
    probs.requires_grad_(True)
    dispatcher = cls(E, K, groups)
    rows, tokens_per_expert, row_probs = dispatcher.dispatch(hidden, probs, routing)

    # what reached this rank: every tp_ep peer's tokens of each local expert, grouped expert-major
    first, local = dispatcher.first_expert, dispatcher.num_local_experts
    assert tokens_per_expert.device.type == "cpu" and tokens_per_expert.dtype == torch.int64
    peers = {r: _rank_data(r, num_tokens_of(r)) for r in groups.ranks["tp_ep"]}
    for i, (chunk, chunk_probs) in enumerate(zip(rows.split(tokens_per_expert.tolist()),
                                                 row_probs.split(tokens_per_expert.tolist()))):
        e = first + i
        expected = sorted((r * 100 + t, p[t, e].item()) for r, (_, p, m) in peers.items() for t in range(m.shape[0]) if m[t, e])
        got = sorted(zip(chunk[:, 0].tolist(), chunk_probs.tolist()))
        assert got == expected, (cls.__name__, e)
        assert int(tokens_per_expert[i]) == len(expected)
    if first <= NEVER < first + local:
        assert int(tokens_per_expert[NEVER - first]) == 0

    out = dispatcher.combine(_experts(rows, tokens_per_expert, row_probs, first, groups))
    grad_out = torch.randint(-8, 9, out.shape, generator=torch.Generator().manual_seed(7 + rank)).float() / 4
    out.backward(grad_out)

    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref_probs = probs.detach().clone().requires_grad_(True)
    ref = _reference(ref_hidden, ref_probs, routing)
    ref.backward(grad_out)
    assert torch.equal(out, ref), (cls.__name__, (out - ref).abs().max())
    assert torch.equal(hidden.grad, ref_hidden.grad), (cls.__name__, (hidden.grad - ref_hidden.grad).abs().max())
    assert torch.equal(probs.grad, ref_probs.grad), (cls.__name__, (probs.grad - ref_probs.grad).abs().max())
    return tokens_per_expert.tolist()


def _dispatch_layouts(rank, world, layouts):
    seen = []
    for tp, ep, etp in layouts:
        groups = build_groups(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        try:
            counts = _check_dispatch(groups, AllToAllDispatcher, lambda r: TOKENS[r])
            assert _check_dispatch(groups, AllGatherDispatcher, lambda r: 4) is not None
            seen.append((groups.ep_size, groups.etp_size, counts))
        finally:
            groups.destroy()
    return seen


def test_dispatchers_world2_ep2_equal_one_process():
    out = run_distributed(_dispatch_layouts, 2, [(1, 1, None), (1, 2, None)])
    # ep=1: every expert here; rank 0 routes to experts 0-3 only, rank 1 never to 7
    assert out[0][0] == (1, 1, (_rank_data(0, 5)[2].sum(0)).tolist())
    assert [s[:2] for s in out[1]] == [(1, 1), (2, 1)]


def test_dispatchers_world4_ep4_ep2xetp2_folded():
    # (tp, ep, etp): EP=4; EP=2 x ETP=2 (etp null = tp); EP=2 folded over tp=2 with etp=1
    out = run_distributed(_dispatch_layouts, 4, [(1, 4, None), (2, 2, None), (2, 2, 1)])
    assert [s[:2] for s in out[0]] == [(4, 1), (2, 2), (2, 1)]
    assert out[3][0][2][1] == 0  # ep=4: EP rank 3 holds experts 6 and 7; 7 receives nothing


# --- the collectives alone ------------------------------------------------------------------------
def _uneven_collectives(rank, world):
    group = dist.group.WORLD
    # rank r sends (r + 1)·(j + 1) rows to rank j; row values say (source, destination)
    in_sizes = [(rank + 1) * (j + 1) for j in range(world)]
    out_sizes = [(j + 1) * (rank + 1) for j in range(world)]
    x = torch.cat([torch.full((n, 3), 10.0 * rank + j) for j, n in enumerate(in_sizes)]).requires_grad_(True)
    y = all_to_all(x, group, output_split_sizes=out_sizes, input_split_sizes=in_sizes)
    assert torch.equal(y, torch.cat([torch.full((n, 3), 10.0 * j + rank) for j, n in enumerate(out_sizes)]))
    y.backward(y * 2)  # each row's grad is 2 × its value: back where it came from
    assert torch.equal(x.grad, 2 * x.detach())

    sizes = [2, 0, 3, 1][:world]
    a = torch.full((sizes[rank], 2), float(rank + 1), requires_grad=True)
    gathered = gather_from_sequence_parallel_region(a, group, output_split_sizes=sizes)
    assert torch.equal(gathered, torch.cat([torch.full((n, 2), float(r + 1)) for r, n in enumerate(sizes)]))
    gathered.backward(torch.full(gathered.shape, float(rank + 1)))  # partial grads: summed over ranks
    assert torch.equal(a.grad, torch.full(a.shape, float(sum(range(1, world + 1)))))

    b = torch.arange(sum(sizes) * 2, dtype=torch.float32).view(-1, 2).mul(rank + 1).requires_grad_(True)
    scattered = reduce_scatter_to_sequence_parallel_region(b, group, input_split_sizes=sizes)
    start = sum(sizes[:rank])
    full = torch.arange(sum(sizes) * 2, dtype=torch.float32).view(-1, 2) * sum(range(1, world + 1))
    assert torch.equal(scattered, full[start:start + sizes[rank]])
    scattered.backward(torch.full(scattered.shape, float(rank)))
    assert torch.equal(b.grad, torch.cat([torch.full((n, 2), float(r)) for r, n in enumerate(sizes)]))
    return True


def test_uneven_all_to_all_gather_reduce_scatter_world4():
    assert run_distributed(_uneven_collectives, 4) == [True] * 4
