"""The unfused attention core (used for head dims > 256 on CUDA) computes SDPA's math."""

import math

import pytest
import torch
import torch.nn.functional as F

from harness import run_distributed
from mptrain.layers.attention import unfused_attention
from train_utils import read_rows, run_job


@pytest.mark.parametrize("masked", [False, True])
def test_unfused_core_equals_sdpa_fp32(masked):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    mask = None
    if masked:  # a reset-attention-mask style block-diagonal causal mask (True = masked)
        mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
        mask[8:, :8] = True
        mask = mask.expand(2, 1, 16, 16)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask, is_causal=mask is None)
    out = unfused_attention(q, k, v, mask, 0.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # fp32: only summation order differs


def test_unfused_core_bf16_close_to_fp32():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    ref = unfused_attention(q, k, v, None, 0.0)
    out = unfused_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 0.0)
    # bf16 has 8 mantissa bits: inputs, scores and probabilities each round at ~4e-3 relative
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)
    assert math.isfinite(out.float().sum().item())


def test_training_with_unfused_backend_matches_sdpa(tmp_path):
    base = ["model=tiny", "train.train_iters=3", "train.eval_interval=null", "parallel=tp2pp1"]
    for backend in ("sdpa", "unfused"):
        run_distributed(run_job, 2, base + [f"model.attention_backend={backend}", f"run.dir={tmp_path / backend}"])
    a, b = read_rows(tmp_path / "sdpa"), read_rows(tmp_path / "unfused")
    for x, y in zip(a, b):  # fp32, same math, different kernels: DESIGN.md §3 tolerances
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
