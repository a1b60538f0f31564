#!/usr/bin/env python3
"""A plain eager PyTorch GPT on the CPU: the overhead floor mptrain's tp1pp1 step is compared with.

    OMP_NUM_THREADS=1 python bench/cpu_reference.py [--layers 4 --hidden 128 --heads 4 --seq 64 --mbs 12
        --vocab 1024 --iters 40 --warmup 5]

The same math as mptrain's GPT at tp1pp1 fp32 with dropout 0 (learned absolute positions, pre-LN
LayerNorm, GeLU MLP 4h, SDPA causal attention, tied embeddings, vocab padded to 128, masked token-mean
cross entropy), one micro-batch a step, torch AdamW (lr 1e-3, wd 0.01, torch's default kernel choice)
and ``clip_grad_norm_(1.0)``; mock tokens (uniform random ids). Prints one JSON line: the median and
mean step time (seconds, after warm-up) and tokens/s. No Hydra, no process group, no trainer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h: int, nh: int) -> None:
        super().__init__()
        self.nh = nh
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.nh, h // self.nh).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, h: int, nh: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, nh) for _ in range(layers))
        self.lnf = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
        return (losses * mask.reshape(-1)).sum() / mask.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 4), ("hidden", 128), ("heads", 4), ("seq", 64), ("mbs", 12), ("vocab", 1024),
                          ("iters", 40), ("warmup", 5)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    times = []
    for i in range(a.warmup + a.iters):
        t0 = time.perf_counter()
        tokens = torch.randint(0, 1000, (a.mbs, a.seq + 1), generator=gen)
        mask = torch.ones(a.mbs, a.seq)
        loss = model(tokens[:, :-1], tokens[:, 1:], mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # the host reads the loss every step, as a trainer's log does
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    tok = a.mbs * a.seq
    print(json.dumps({"trainer": "torch-reference", "device": "cpu", "layers": a.layers, "hidden": a.hidden,
                      "seq": a.seq, "mbs": a.mbs, "iter_s_median": statistics.median(times),
                      "iter_s_mean": statistics.fmean(times), "tokens_per_s": tok / statistics.median(times),
                      "threads": torch.get_num_threads(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
