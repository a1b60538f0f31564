#!/usr/bin/env python3
"""What plain PyTorch reaches on one GPU for a small Mixtral-like MoE GPT (the MoE peer of `torch_ceiling.py`).

The shape of ``conf/model/moe_mixtral_small.yaml`` unless the environment gives another: 12 layers, hidden 1024,
16 heads in 8 query groups (head dim 64), RoPE (base 1e6, rotate-half), RMSNorm (eps 1e-5), no biases, untied
output layer, vocab 32000, sequence 2048; every layer's MLP an MoE of 8 SwiGLU experts of width 3584, top-2.

Routing (Mixtral / Megatron-core's defaults): router logits in fp32, top-k on the logits, weights = softmax over
the k chosen logits; Switch load-balancing loss ``coeff · E · Σ_i f_i · P_i`` (f_i = tokens routed to expert i /
(T·k), P_i = mean softmax score of i), coeff 0.01, added to the loss; dropless. Permutation: the T·k (token,
slot) rows sorted by expert (a stable argsort: static [T·k, h] shapes), ``offs`` = the per-expert row counts'
cumsum on the device, both expert GEMMs as ``torch._grouped_mm``; combine writes each row back to its (token,
slot) place and sums the k slots. No host read in the step; the whole model is one ``torch.compile`` graph.

Variants: ``compile_amp`` (fp32 parameters, the blocks' GEMMs in bf16 under autocast, the experts' weights cast
to bf16 in the graph, fused AdamW on fp32: the arithmetic of mptrain's ``precision=bf16`` with its fp32 main
weights); ``compile_bf16`` (bf16 parameters, no fp32 copy: an upper bound on kernel speed).
Prints one JSON line per variant (``iter_s``: mean seconds per iteration; `bench/run_bench.py` counts the FLOPs
with mptrain's own formula on the active parameters).
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_ceiling import time_iterations  # the same training loop as the dense reference (this folder)

L, H, NH, S = (int(os.environ.get(k, d)) for k, d in (("LAYERS", 12), ("HIDDEN", 1024), ("HEADS", 16), ("SEQ", 2048)))
G = int(os.environ.get("QUERY_GROUPS", 8))  # query groups (key/value heads)
FF = int(os.environ.get("EXPERT_FFN", 3584))
E, K = int(os.environ.get("EXPERTS", 8)), int(os.environ.get("TOPK", 2))
AUX = float(os.environ.get("AUX_COEFF", 0.01))
V = int(os.environ.get("VOCAB_PADDED", 32000))
VOCAB = int(os.environ.get("VOCAB", 32000))
MBS, M = int(os.environ.get("MBS", 4)), int(os.environ.get("M", 8))
CLIP = float(os.environ.get("CLIP", 1.0))
ITERS, WARMUP = int(os.environ.get("ITERS", 10)), int(os.environ.get("WARMUP", 3))
HD = H // NH
BF16 = torch.bfloat16


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the grad contiguous (``torch._grouped_mm``'s backward wants strided grads)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def rope(x, cos, sin):  # x [b, nh, s, hd]; rotate-half (Megatron / Hugging Face Mixtral)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Parameter(torch.empty(E, H))
        self.w1 = nn.Parameter(torch.empty(E, 2 * FF, H))  # [gate; up] per expert
        self.w2 = nn.Parameter(torch.empty(E, H, FF))

    def forward(self, x):  # x [T, h] -> ([T, h], aux loss)
        t = x.shape[0]
        with torch.autocast("cuda", enabled=False):  # the gating GEMM in fp32 (autocast would run it in bf16)
            logits = F.linear(x.float(), self.router.float())  # [T, E]
        top, idx = logits.topk(K, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)  # [T, k] fp32
        # Switch load balancing: counts from the top-k of the full softmax (the same experts)
        scores = torch.softmax(logits, dim=-1)
        flat = idx.reshape(-1)  # [T·k] expert of each (token, slot)
        counts = (flat.unsqueeze(1) == torch.arange(E, device=x.device)).sum(0)  # [E], static shape
        aux = AUX * E * (scores.mean(0) * counts.float() / (t * K)).sum()
        # permute: rows sorted by expert (stable: tokens in order within an expert)
        order = flat.argsort(stable=True)  # [T·k] (token, slot) index of each row
        rows = ContiguousGrad.apply(x.to(BF16).index_select(0, order // K))  # [T·k, h]
        offs = counts.cumsum(0).to(torch.int32)
        h1 = torch._grouped_mm(rows, self.w1.to(BF16).transpose(1, 2), offs=offs)  # [T·k, 2f]
        gate, up = h1.chunk(2, dim=-1)
        a = (F.silu(gate) * up * weights.reshape(-1).index_select(0, order).unsqueeze(1)).to(BF16)
        y = torch._grouped_mm(ContiguousGrad.apply(a), self.w2.to(BF16).transpose(1, 2), offs=offs)  # [T·k, h]
        # unpermute: each row to its (token, slot) place, the k slots summed
        out = torch.zeros_like(y).index_copy(0, order, y).view(t, K, H).sum(1)
        return out, aux


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(H, eps=1e-5), nn.RMSNorm(H, eps=1e-5)
        self.qkv = nn.Linear(H, (NH + 2 * G) * HD, bias=False)
        self.proj = nn.Linear(H, H, bias=False)
        self.moe = MoE()

    def forward(self, x, cos, sin):  # x [b, s, h]
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, NH + 2 * G, HD).transpose(1, 2).split([NH, G, G], dim=1)
        a = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, H))
        y, aux = self.moe(self.n2(x).reshape(b * s, H))
        return x + y.view(b, s, H).to(x.dtype), aux


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm = nn.RMSNorm(H, eps=1e-5)
        self.head = nn.Linear(H, V, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)
        inv = 1.0 / (1e6 ** (torch.arange(0, HD, 2).float() / HD))
        ang = torch.outer(torch.arange(S).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)  # [s, hd]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx, tgt):
        x = self.wte(idx)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        aux = 0.0
        for blk in self.blocks:
            x, a = blk(x, cos, sin)
            aux = aux + a
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, V), tgt.reshape(-1)) + aux


def run(name, pure_bf16):
    torch.manual_seed(0)
    model = GPT().cuda()
    if pure_bf16:
        model = model.to(BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    dt, loss = time_iterations(model, torch.compile(model), opt, vocab=VOCAB, mbs=MBS, m=M, seq=S, clip=CLIP,
                               warmup=WARMUP, iters=ITERS, pure_bf16=pure_bf16)
    r = {"name": name, "iter_s": dt, "tokens_per_s": MBS * M * S / dt,
         "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": loss, "torch": torch.__version__,
         "shape": [L, H, NH, G, S, E, K, FF], "mbs": MBS, "m": M, "clip": CLIP, "vocab": VOCAB, "vocab_padded": V}
    print(json.dumps(r), flush=True)
    torch.cuda.empty_cache()


if __name__ == "__main__":
    for w in sys.argv[1:] or ["compile_amp", "compile_bf16"]:
        run(w, pure_bf16=w.endswith("bf16"))
