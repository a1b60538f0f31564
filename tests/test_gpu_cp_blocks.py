"""The ring's CUDA block kernel (ATen flash attention with the final out and lse) on one GPU (marker ``gpu``).

Each block of a ring step, forward and backward, through the flash kernel in bf16 against the fp32 matmul
block on the same (bf16-rounded) inputs: the causal diagonal block, a full block, and the second half of the
queries against a whole block with the merged log-sum-exp of the full row (what the backward gets).
With document masking, every rank of a cp4 ring computed on the one GPU (`ring_on_one_device`: the ring's step
functions with the K/V handed over by indexing) against fp32 attention under the dense document mask.
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


def ring_on_one_device(q, k, v, dout, mask, cp: int, kernel: str):
    """The document-masked ring's per-rank computation for every rank of a cp-ring on one device (K/V handed over
    by indexing instead of messages): per rank (out, dq) of its slice, and dK/dV of its slice, in fp32."""
    from mptrain.layers.context_parallel import slice_sequence
    from mptrain.layers.cp_attention import backward_blocks, forward_blocks
    from mptrain.layers.cp_blocks import document_plan

    rep = q.shape[1] // k.shape[1]
    held = {r: torch.stack([slice_sequence(k, 2, cp, r), slice_sequence(v, 2, cp, r)]) for r in range(cp)}
    dkv = {r: torch.zeros(held[r].shape, dtype=torch.float32, device=q.device) for r in range(cp)}
    results = {}
    for r in range(cp):
        plan = document_plan(mask, cp, r)
        q_r, dout_r = slice_sequence(q, 2, cp, r), slice_sequence(dout, 2, cp, r)
        out = torch.zeros(q_r.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q_r.shape[:3], float("-inf"), device=q.device)
        meta = None
        for step in range(cp):
            meta = forward_blocks(kernel, q_r, held[(r - step) % cp], plan[step], out, lse, rep) or meta
        final = out.to(q.dtype)
        delta = (dout_r.float() * final.float()).sum(-1)
        dq = torch.zeros(q_r.shape, dtype=torch.float32, device=q.device)
        for step in range(cp):
            src = (r - step) % cp
            dkv[src] += backward_blocks(kernel, q_r, held[src], plan[step], dout_r, final, lse, delta, dq, rep, meta)
        results[r] = (out, dq)
    return results, dkv


def document_reference(q, k, v, dout, mask):
    """fp32 attention under the dense document mask (the same, half-rounded, inputs): out, dq, dk, dv."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=~mask.dense())
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def test_the_document_masked_ring_on_cuda_equals_the_dense_mask():
    """cp4 over s = 2048 (chunks of 256) in bf16 with grouped-query heads: documents that cut chunks (masked
    blocks), one that covers whole chunks (flash blocks, full and causal) and pairs no query sees (skipped)."""
    from mptrain.layers.context_parallel import slice_sequence
    from mptrain.layers.cp_blocks import CAUSAL, FULL, MASKED, document_plan
    from mptrain.layers.document_mask import DocumentMask

    cp, s, b, hq, hk, d = 4, 2048, 2, 8, 2, 64
    starts = [[0, 100, 700, 1300, 1310], [0, 40, 900, 1200]]
    mask = DocumentMask(torch.tensor([row + [s] * (s + 1 - len(row)) for row in starts], device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(b, hq, s, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    assert block_kernel(q) == "cuda_flash"
    kinds = {blk.kind for r in range(cp) for step in document_plan(mask, cp, r) for blk in step}
    assert kinds == {CAUSAL, FULL, MASKED}
    # rank 0 holds chunks 0 and 7: at every later step chunk 7 against the held second chunk only (both sequences'
    # chunk 7 lies in a document that starts after the held first chunk: skipped)
    assert [[(blk.rows.start, blk.cols.start, blk.kind) for blk in step] for step in document_plan(mask, cp, 0)] == [
        [(0, 0, MASKED), (256, 256, CAUSAL)], [(256, 256, MASKED)], [(256, 256, MASKED)], [(256, 256, FULL)]]
    results, dkv = ring_on_one_device(q, k, v, dout, mask, cp, "cuda_flash")
    ref_out, ref_dq, ref_dk, ref_dv = document_reference(q, k, v, dout, mask)
    # bf16 inputs, fp32 merging: the flash blocks round their outputs to bf16 (2^-8), hence the tolerance
    for r in range(cp):
        got = (*results[r], dkv[r][0], dkv[r][1])
        want = (ref_out, ref_dq, ref_dk, ref_dv)
        for name, a, e in zip(("out", "dq", "dk", "dv"), got, want):
            e = slice_sequence(e, 2, cp, r)
            err = (a - e).abs().max().item() / max(e.abs().max().item(), 1e-6)
            assert err < 2e-2, (r, name, err)
