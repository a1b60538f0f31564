"""GPU-only paths (marker ``gpu``; skipped without CUDA).

`grad_accumulation.wgrad_accumulate` on CUDA: half inputs accumulate into an fp32 ``main_grad`` through
``aten::addmm.dtype_out`` (CPU has no such kernel and takes the unfused path, which the CPU tests
cover), fp32 inputs through ``addmm_``. Both against an fp64 reference of two accumulations.

`grad_accumulation.weight_grad` under TF32 with the K-major Xᵀ copy against
the plain layout and fp64, into main_grad and returned.

`mixed_add.add_into` (half grads into an fp32 ``main_grad``, the FP8 weight-grad path) bitwise against
``add_``, directly and through `grad_accumulation.accumulate_into` inside a compiled function.
"""

from __future__ import annotations

import pytest
import torch

from mptrain.layers import mixed_add
from mptrain.layers.grad_accumulation import accumulate_into, tf32_kmajor_pays, weight_grad, wgrad_accumulate
from mptrain.layers.transpose import transpose_copy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wgrad_accumulate_into_fp32_main_grad(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator(device="cuda").manual_seed(0)
    s, b, out_f, in_f = 256, 2, 384, 512
    main_grad = torch.randn(out_f, in_f, device="cuda", generator=g)
    expected = main_grad.double()
    for _ in range(2):
        go = torch.randn(s, b, out_f, device="cuda", generator=g).to(dtype)
        x = torch.randn(s, b, in_f, device="cuda", generator=g).to(dtype)
        expected += go.double().reshape(-1, out_f).t() @ x.double().reshape(-1, in_f)
        wgrad_accumulate(go.reshape(-1, out_f).t(), x.reshape(-1, in_f).t(), main_grad)
    assert main_grad.dtype == torch.float32
    # fp32 accumulation of exact half products (sums of 512 terms of O(1)): fp32 rounding only;
    # the unfused path (product rounded to half, then added) is ~1e-2 off for bf16
    err = float((main_grad.double() - expected).abs().max() / expected.abs().max())
    assert err < 1e-5, err


@pytest.mark.parametrize("out_f, in_f", [(384, 256), (256, 384)])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("gathered_input", [False, True])  # .t().contiguous() / the Triton copy
def test_weight_grad_kmajor_tf32(out_f, in_f, fused, gathered_input):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        go = torch.randn(512, out_f, device="cuda", generator=g)
        x = torch.randn(512, in_f, device="cuda", generator=g)
        assert tf32_kmajor_pays(go)
        expected = go.double().t() @ x.double()
        got = {}
        for kmajor in (True, False):
            main_grad = torch.zeros(out_f, in_f, device="cuda") if fused else None
            ret = weight_grad(go, x, main_grad, kmajor, gathered_input=gathered_input)
            got[kmajor] = main_grad if fused else ret
            assert (ret is None) == fused
        for kmajor, w in got.items():  # TF32: 10-bit mantissa products, fp32 sums of 512 terms
            err = float((w.double() - expected).abs().max() / expected.abs().max())
            assert err < 5e-3, (kmajor, err)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transpose_copy(dtype):
    """The Triton transposed copy: ragged tiles, a strided (sliced) input, and inside torch.compile."""
    x = torch.randn(300, 200, device="cuda").to(dtype)
    for src in (x, x[:, 10:150], x[::2], x.t()):  # contiguous, sliced, row-strided, column-strided
        got = transpose_copy(src)
        assert got.is_contiguous() and torch.equal(got, src.t())
    compiled = torch.compile(lambda t: transpose_copy(t * 2))
    assert torch.equal(compiled(x), (x * 2).t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_add_into_fp32(dtype):
    """The Triton ``fp32 += half`` kernel: the same bits as ``add_``, with a ragged last block; a
    non-contiguous grad takes ``add_``; inside torch.compile the op still adds in place."""
    g = torch.Generator(device="cuda").manual_seed(2)
    for shape in ((2048, 6144), (300, 77)):  # a whole number of blocks, and a ragged one
        main_grad = torch.randn(shape, device="cuda", generator=g) * 100
        grad = torch.randn(shape, device="cuda", generator=g).to(dtype)
        expected = main_grad.clone().add_(grad)
        assert mixed_add._kernel_applies(main_grad, grad)
        mixed_add.add_into(main_grad, grad)
        assert torch.equal(main_grad, expected)
    strided = torch.randn(77, 300, device="cuda", generator=g).to(dtype).t()
    assert not mixed_add._kernel_applies(main_grad, strided)
    mixed_add.add_into(main_grad, strided)
    assert torch.equal(main_grad, expected.add_(strided))

    def step(m, x):
        accumulate_into(m, x * 2)

    main_grad = torch.randn(256, 384, device="cuda", generator=g)
    grad = torch.randn(256, 384, device="cuda", generator=g).to(dtype)
    expected = main_grad.clone().add_(grad * 2)
    torch.compile(step, fullgraph=True)(main_grad, grad)
    assert torch.equal(main_grad, expected)
