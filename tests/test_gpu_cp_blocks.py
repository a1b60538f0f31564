"""The ring's CUDA block kernel (ATen flash attention with the final out and lse) on one GPU (marker ``gpu``).

Each block of a ring step, forward and backward, through the flash kernel in bf16 against the fp32 matmul
block on the same (bf16-rounded) inputs: the causal diagonal block, a full block, and the second half of the
queries against a whole block with the merged log-sum-exp of the full row (what the backward gets).
"""

from __future__ import annotations

import pytest
import torch

from mptrain.layers.cp_attention import _bwd, _fwd, block_kernel, merge

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_flash_blocks_equal_the_fp32_matmul_blocks():
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, c, d = 2, 4, 256, 64
    q, k0, k1, v0, v1, dout = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
                               for n in (2 * c, c, c, c, c, 2 * c))
    assert block_kernel(q) == "cuda_flash"
    # a rank's row set: causal against its own block (k0, v0 here of 2c), then the tail half against another block
    own_k, own_v = torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)
    other_k, other_v = k1.flip(2), v0.flip(2)
    results = {}
    for kernel in ("cuda_flash", "matmul"):
        out = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        lse = torch.full(q.shape[:3], float("-inf"), device="cuda")
        o, l, meta = _fwd(kernel, q, own_k, own_v, True)
        merge(out, lse, o, l)
        o, l, _ = _fwd(kernel, q[:, :, c:], other_k, other_v, False)
        merge(out[:, :, c:], lse[:, :, c:], o, l)
        final = out.to(torch.bfloat16)
        delta = (dout.float() * final.float()).sum(-1)
        own = _bwd(kernel, q, own_k, own_v, dout, final, lse, delta, True, meta)
        tail = _bwd(kernel, q[:, :, c:], other_k, other_v, dout[:, :, c:], final[:, :, c:], lse[:, :, c:],
                    delta[:, :, c:], False, meta)
        results[kernel] = (out, lse, *own, *tail)
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv", "dq_tail", "dk_other", "dv_other"),
                          results["cuda_flash"], results["matmul"]):
        err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-6)
        assert err < 2e-2, (name, err)
