"""Compiled vs eager TP layers on the real backend: loss and every weight grad (issue 10 diagnosis).

Run with torchrun on 2 GPUs (NCCL) or CPU processes (gloo)::

    torchrun --nproc_per_node=2 bench/scripts/compile_tp_check.py --out results.json

For each case (shape × dtype × tp) it builds the same GPT twice from one seed, eager and with
``model.compile_layers``, runs forward + backward twice (the second call runs the cached graph)
and prints the relative error of the loss and of each grad. ``--reduce`` variants replace the
row-parallel forward all-reduce under compile (``code`` = the package: functional all_reduce +
wait_tensor; ``inplace`` = mark_dirty on the matmul output; ``clone_c10d`` = the code before the
fix, clone + in-place ``dist.all_reduce``, which on NCCL left every layer weight grad wrong).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
from mptrain.config.model import ModelConfig  # noqa: E402
from mptrain.config.parallel import ParallelConfig  # noqa: E402
from mptrain.groups import build_groups  # noqa: E402
from mptrain.layers import linear, mappings  # noqa: E402
from mptrain.layers.gpt import build_model_chunks  # noqa: E402

SHAPES = {
    "small": dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256, micro=2),
    "seed4": dict(num_layers=4, hidden_size=4096, num_attention_heads=8, seq_length=1024, micro=2),
}
VOCAB = 1000
_ORIG_FORWARD = mappings._ReduceFromTP.forward


def _fwd_clone_c10d(ctx, x, group, inplace):
    """The code before the fix: clone + in-place c10d all-reduce, which Dynamo rewrites under compile."""
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y


def _reduce_inplace(x, group, inplace=False):
    return mappings.reduce_from_tp_region(x, group, inplace=True)


def _set_reduce(variant: str) -> None:
    """code: the package as is (functional collectives under compile); inplace: mark_dirty on the matmul
    output under compile too; clone_c10d: the pre-fix forward (to reproduce the NCCL-only grad error)."""
    mappings._ReduceFromTP.forward = staticmethod(_fwd_clone_c10d if variant == "clone_c10d" else _ORIG_FORWARD)
    linear.reduce_from_tp_region = _reduce_inplace if variant == "inplace" else mappings.reduce_from_tp_region


def _run(groups, shape: dict, tp: int, dtype, compile_layers: bool, device, attention_backend: str):
    micro = shape["micro"]
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k != "micro"}, compile_layers=compile_layers,
                      make_vocab_size_divisible_by=8, attention_backend=attention_backend)
    model = build_model_chunks(cfg, ParallelConfig(tensor_model_parallel_size=tp), groups, vocab_size=VOCAB,
                               seed=7, params_dtype=dtype, device=device)[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (micro, cfg.seq_length), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (micro, cfg.seq_length), generator=gen).to(device)
    for _ in range(2):  # 2 micro-batches accumulated, twice (the second time runs the cached graphs)
        model.zero_grad(set_to_none=True)
        for m in range(2):
            loss = model(ids.roll(m, dims=1), labels=labels.roll(m, dims=1))
            loss.float().mean().backward()
    grads = {n: (p.grad if p.grad is not None else torch.full_like(p, float("nan"))).detach().float().clone()
             for n, p in model.named_parameters()}
    return loss.detach().float(), grads


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _cross_entropy_check(device, rank: int) -> list:
    """Fused (compiled three-pass) vs plain vocab-parallel cross entropy, one rank, padded vocab."""
    from mptrain.layers.cross_entropy import vocab_parallel_cross_entropy
    rows = []
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        gen = torch.Generator().manual_seed(1)
        logits = (3 * torch.randn(1024, 2, 50304, generator=gen)).to(device=device, dtype=dtype)
        target = torch.randint(0, 50257, (1024, 2), generator=gen).to(device)
        out = {}
        for fused in (False, True):
            x = logits.clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(x, target, vocab_size=50257, fused=fused)
            loss.mean().backward()
            out[fused] = (loss.detach().float(), x.grad.float())
        ref = torch.nn.functional.cross_entropy(logits.float()[..., :50257].reshape(-1, 50257), target.reshape(-1),
                                                reduction="none").view(1024, 2)
        row = dict(rank=rank, check="cross_entropy", dtype=dname, loss_rel_fused_vs_plain=_rel(out[True][0], out[False][0]),
                   grad_rel_fused_vs_plain=_rel(out[True][1], out[False][1]), loss_rel_plain_vs_torch=_rel(out[False][0], ref))
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="small,seed4")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--tps", default="2,1")
    ap.add_argument("--reduce", default="code,clone_c10d")
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = dist.get_rank()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for shape_name in args.shapes.split(","):
        for dname in args.dtypes.split(","):
            for tp in map(int, args.tps.split(",")):
                groups = build_groups(tp, 1, device=device)
                _set_reduce("code")
                torch._dynamo.reset()
                ref_loss, ref_grads = _run(groups, SHAPES[shape_name], tp, dtypes[dname], False, device,
                                           args.attention_backend)
                for variant in (args.reduce.split(",") if tp > 1 else ["code"]):
                    _set_reduce(variant)
                    torch._dynamo.reset()
                    got_loss, got_grads = _run(groups, SHAPES[shape_name], tp, dtypes[dname], True, device,
                                               args.attention_backend)
                    errs = {n: _rel(got_grads[n], ref_grads[n]) for n in ref_grads}
                    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:6]
                    row = dict(rank=rank, shape=shape_name, dtype=dname, tp=tp, reduce=variant,
                               loss_rel=_rel(got_loss, ref_loss), grad_rel_max=max(errs.values()),
                               grad_rel_median=sorted(errs.values())[len(errs) // 2], worst=worst)
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
                groups.destroy()
                _set_reduce("code")
    rows += _cross_entropy_check(device, rank)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
