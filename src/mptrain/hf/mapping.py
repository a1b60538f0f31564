"""Two-way tensor mappings between our tp1pp1 parameters and Hugging Face tensors. A `Rule` ties our ``ours`` to the
Hugging Face tensors ``hf`` it is made of: ``to_hf(t)`` gives them, ``from_hf(ts)`` inverts it (reshapes, transposes,
splits, concatenations: exact); an MoE family's grouped expert weights ``[E, ...]`` are `Experts` rules (or direct ones
in transformers 5's fused layout). Fused QKV (`mptrain.layers.attention`): our rows, per query group g
``[q_{g,0..np/ng-1}, k_g, v_g]`` × hn, are viewed ``[ng, np/ng + 2, hn, ...]``; Hugging Face keeps q ``[np·hn]``, k and
v ``[ng·hn]`` head-major, as three tensors (Llama) or one ``[q; k; v]`` (GPT-2's ``c_attn``, ng = np). Sources:
transformers ``modeling_llama.py`` (``LlamaAttention``), ``modeling_gpt2.py`` (``Conv1D``); Megatron-LM
``tools/checkpoint/loader_llama_mistral.py``.
"""

import dataclasses

import torch


def _t(t: torch.Tensor) -> torch.Tensor:
    return t.t() if t.dim() == 2 else t  # a bias stays as it is


@dataclasses.dataclass(frozen=True)
class Rule:
    """Direct: ``hf[0]`` is our tensor as is (embeddings, norms, most linears), or with ``transpose`` our weight
    transposed, ``[in, out]`` (GPT-2's Conv1D; a bias as is)."""

    ours: str
    hf: tuple
    transpose: bool = False

    def to_hf(self, t: torch.Tensor) -> tuple:
        return (_t(t) if self.transpose else t,)

    def from_hf(self, ts: list) -> torch.Tensor:
        return _t(ts[0]) if self.transpose else ts[0]


@dataclasses.dataclass(frozen=True)
class FusedQKV(Rule):
    """Our QKV weight ``[ng·(np/ng + 2)·hn, h]`` / bias <-> q, k, v (three names) or ``[q; k; v]`` (one; ``transpose``)."""

    heads: int = 1
    groups: int = 1

    def to_hf(self, t: torch.Tensor) -> tuple:
        rest, rep = t.shape[1:], self.heads // self.groups
        grouped = t.reshape(self.groups, rep + 2, -1, *rest)  # [ng, np/ng + 2, hn(, h)]
        q, k, v = (p.reshape(-1, *rest) for p in torch.split(grouped, [rep, 1, 1], dim=1))
        fused = torch.cat([q, k, v]) if len(self.hf) == 1 else None
        return (q, k, v) if fused is None else (_t(fused) if self.transpose else fused,)

    def from_hf(self, ts: list) -> torch.Tensor:
        if len(ts) == 1:
            fused = _t(ts[0]) if self.transpose else ts[0]
            hn = fused.shape[0] // (self.heads + 2 * self.groups)
            ts = torch.split(fused, [self.heads * hn, self.groups * hn, self.groups * hn])
        q, k, v = ts
        rest, hn = q.shape[1:], k.shape[0] // self.groups
        parts = [q.reshape(self.groups, -1, hn, *rest), *(x.reshape(self.groups, 1, hn, *rest) for x in (k, v))]
        return torch.cat(parts, dim=1).reshape(-1, *rest)


class GatedMLP(Rule):
    """Our gated MLP's (SwiGLU) ``linear_fc1`` ``[gate; up] = [2f, h]`` <-> ``hf = (gate, up)``."""

    def to_hf(self, t: torch.Tensor) -> tuple:
        return tuple(t.chunk(2, dim=0))

    def from_hf(self, ts: list) -> torch.Tensor:
        return torch.cat(ts, dim=0)


@dataclasses.dataclass(frozen=True)
class Experts(Rule):
    """Our grouped expert weight ``[E, parts·f, h]`` / ``[E, h, f]`` <-> one tensor per expert and part, ``hf`` expert-major
    (``parts`` = 2: gate_0, up_0, gate_1, up_1, ...; our fc1 rows per expert are ``[gate; up]``, as `GatedMLP`'s)."""

    parts: int = 1

    def to_hf(self, t: torch.Tensor) -> tuple:
        return tuple(part for expert in t.unbind(0) for part in expert.chunk(self.parts, dim=0))

    def from_hf(self, ts: list) -> torch.Tensor:
        return torch.stack([torch.cat(ts[e:e + self.parts], dim=0) for e in range(0, len(ts), self.parts)])
