"""The CUDA batch prefetcher (marker ``gpu``; skipped without CUDA): the prepared batches are the host
batches, in order, on the device; an error of the iterator reaches the step that asks for that batch."""

from __future__ import annotations

import pytest
import torch

from mptrain.training.batch import prepare_batch
from mptrain.training.prefetch import BatchPrefetcher

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _batches(n, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"bad batch {i}")
        tokens = torch.arange(i * 32, i * 32 + 32).view(2, 16)
        yield {"tokens": tokens, "labels": tokens + 1, "position_ids": torch.arange(16).expand(2, 16).contiguous(),
               "loss_mask": torch.full((2, 16), float(i))}


def test_prefetched_batches_are_the_host_batches_in_order():
    device = torch.device("cuda")
    taken = []
    prefetcher = BatchPrefetcher(_batches(6, fail_at=5), lambda b: prepare_batch(b, device=device,
                                                                                 with_attention_mask=False),
                                 device=device, depth=2, on_take=taken.append)
    for host in _batches(5):
        got = next(prefetcher)
        packed = got.tensors["packed"].cpu()
        assert packed[0] == 0 and torch.equal(packed[1:33], host["tokens"].reshape(-1))
        assert torch.equal(got.tensors["loss_mask"].cpu(), host["loss_mask"])
        torch.cuda._sleep(1_000_000)  # a long "step" on the compute stream while the next batch is copied
    assert taken == [2] * 5  # counted when taken, not when read ahead
    with pytest.raises(ValueError, match="bad batch 5"):
        next(prefetcher)
    with pytest.raises(ValueError, match="bad batch 5"):  # and again: the iterator stays failed
        next(prefetcher)
    prefetcher.close()
