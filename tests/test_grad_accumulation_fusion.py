"""A user's own linear gets gradient accumulation fusion by implementing `FusesGradAccumulation`.

The DDP wrapper finds fusion targets through the protocol only (no type checks of mptrain's
layers). A model of a user linear (no mptrain base class, the protocol's one method) and a plain
``torch.nn.Linear`` (no protocol): with ``gradient_accumulation_fusion`` the user linear's backward
accumulates into its ``main_grad`` view (its weight never holds a ``.grad``), the torch linear keeps
the hook path, and the grad buffer after two micro-batches equals the unfused run's bitwise (bf16
params, fp32 main grads: on CPU the fused GEMM forms the bf16 product and adds it in fp32, as the hook).
"""

from __future__ import annotations

import torch

from harness import run_distributed
from mptrain.distributed import DistributedDataParallel
from mptrain.groups import build_groups
from mptrain.layers.grad_accumulation_fusion import FusesGradAccumulation
from mptrain.layers.linear import linear

D_IN, D_HIDDEN, D_OUT, TOKENS = 16, 24, 8, 10


class UserLinear(torch.nn.Module):
    """``y = x Wᵀ`` written by a user: fuses by declaring the protocol and passing its view to `linear`."""

    def __init__(self, n_in: int, n_out: int, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in, generator=generator).to(torch.bfloat16))
        self.weight_main_grad = None

    def fuse_grad_accumulation(self, main_grad) -> None:
        self.weight_main_grad = main_grad(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.weight_main_grad)


def _buffer_after_two_microbatches(rank, world, fused: bool) -> dict:
    groups = build_groups(1, 1)
    try:
        g = torch.Generator().manual_seed(5)
        user = UserLinear(D_IN, D_HIDDEN, g)
        plain = torch.nn.Linear(D_HIDDEN, D_OUT, dtype=torch.bfloat16)
        with torch.no_grad():
            plain.weight.copy_(torch.randn(D_OUT, D_HIDDEN, generator=g))
            plain.bias.copy_(torch.randn(D_OUT, generator=g))
        model = torch.nn.Sequential(user, torch.nn.GELU(), plain)
        seen = {"user": [], "plain": []}  # registered before DDP's hooks: sees the grad they are handed
        user.weight.register_post_accumulate_grad_hook(lambda p: seen["user"].append(p.grad is not None))
        plain.weight.register_post_accumulate_grad_hook(lambda p: seen["plain"].append(p.grad is not None))
        ddp = DistributedDataParallel(model, groups, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      bucket_size=None, use_distributed_optimizer=False,
                                      gradient_accumulation_fusion=fused)
        for _ in range(2):
            x = torch.randn(TOKENS, 1, D_IN, generator=g).to(torch.bfloat16)  # [s, b, h]
            ddp(x).float().pow(2).mean().backward()
        view = user.weight_main_grad
        main = ddp.main_grad(user.weight)
        return {"data": ddp.grad_buffers[0].data.clone(), "seen": seen,
                "is_view": view is not None and view.data_ptr() == main.data_ptr() and view.shape == main.shape,
                "user_weight_main_grad": None if view is None else view.clone(),
                "user_main_grad": main.clone(), "plain_main_grad": ddp.main_grad(plain.weight).clone(),
                "declares": [isinstance(m, FusesGradAccumulation) for m in model]}
    finally:
        groups.destroy()


def test_user_linear_implementing_the_protocol_gets_fusion():
    fused, = run_distributed(_buffer_after_two_microbatches, 1, True)
    unfused, = run_distributed(_buffer_after_two_microbatches, 1, False)
    assert fused["declares"] == [True, False, False]
    assert fused["is_view"] and unfused["user_weight_main_grad"] is None
    assert fused["seen"] == {"user": [False, False], "plain": [True, True]}  # fused: no .grad; torch's: the hook path
    assert unfused["seen"] == {"user": [True, True], "plain": [True, True]}
    assert torch.equal(fused["data"], unfused["data"])
    assert torch.equal(fused["user_main_grad"], unfused["user_main_grad"])
    assert torch.equal(fused["user_weight_main_grad"], fused["user_main_grad"])
    assert fused["user_main_grad"].abs().sum() > 0 and fused["plain_main_grad"].abs().sum() > 0
