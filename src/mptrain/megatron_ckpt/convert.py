"""A Megatron-LM checkpoint (torch_dist or legacy, any TP / PP / VPP) as an mptrain checkpoint to train from.

Names: megatron-core's GPTModel and mptrain's share them (``embedding.word_embeddings.weight``,
``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...; docs/CHECKPOINTS.md), but for Transformer Engine's
norms fused into the following linear (`TE_NORMS`). Layouts: the global (tp1) tensors are the same on both
sides: the fused QKV rows per query group ``[q_{g,0..np/ng-1}, k_g, v_g] × hn`` (``[ng·(np/ng + 2)·hn, h]``,
`mptrain.layers.attention`), SwiGLU's ``linear_fc1`` ``[gate; up]``. A legacy checkpoint's TP shards are
joined on the dim mptrain's `ShardSpec` splits (Megatron's split: column-parallel rows, row-parallel columns,
vocab rows), SwiGLU's per rank ``[gate_r; up_r]`` taken apart first (``ShardSpec.interleave``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch

from mptrain.checkpoint import offline
from mptrain.errors import ConfigError
from mptrain.megatron_ckpt.args import model_from_args, tokenizer_from_args
from mptrain.megatron_ckpt.reader import Source, read_checkpoint, vocab_rows

TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
"""Transformer Engine's layer spec (``TELayerNormColumnParallelLinear``) -> the local spec's, within a layer."""

FRESH = ("the optimizer state, LR schedule, loss scaler and consumed samples start fresh (the import is iteration 0, "
         "as Megatron's --finetune loads a checkpoint)")


def our_name(name: str) -> str:
    """mptrain's name of a Megatron tensor (global layer index): the same, but for `TE_NORMS`."""
    m = re.fullmatch(r"(decoder\.layers\.\d+\.)(.+)", name)
    return m.group(1) + TE_NORMS[m.group(2)] if m and m.group(2) in TE_NORMS else name


def joined_shape(src: Source, spec) -> tuple:
    """The shape of ``src``'s TP shards joined along ``spec.partition_dim`` (a replicated tensor: one copy)."""
    shape = list(src.shapes[0])
    if spec.partition_dim is not None:
        shape[spec.partition_dim] = sum(s[spec.partition_dim] for s in src.shapes)
    return tuple(shape)


def join_shards(shards: list, spec) -> torch.Tensor:
    """The global tensor of Megatron's TP shards (TP-rank order): ``cat`` on ``spec.partition_dim``, part by part
    for an interleaved one (rank r of SwiGLU's fc1 holds ``[gate_r; up_r]``: ``[gate_0; gate_1; ...; up_0; ...]``);
    a replicated tensor is the same on every rank (rank 0's)."""
    if spec.partition_dim is None or len(shards) == 1:
        return shards[0]
    d, k = spec.partition_dim, spec.interleave
    parts = [s.chunk(k, dim=d) for s in shards]  # per rank: its k parts
    return torch.cat([rank[j] for j in range(k) for rank in parts], dim=d)


def _tensors(ckpt, model: dict) -> dict:
    """{our name: (shape, dtype, loader)}; ConfigError (one line): a tensor missing, extra or of another shape."""
    specs = offline.shard_specs(model)
    tied = not model["untie_embeddings_and_output_weights"]
    found = {our_name(n): src for n, src in ckpt.tensors.items()
             if not (tied and n == "output_layer.weight")}  # tied: a later stage's copy of the embedding
    missing, extra = sorted(set(specs) - set(found)), sorted(set(found) - set(specs))
    if missing or extra:
        raise ConfigError(f"import-megatron: the tensors of {ckpt.folder} do not match its args: missing {missing[:4]}, "
                          f"not in the model {extra[:4]}")
    out = {}
    for name, spec in specs.items():
        src, want = found[name], tuple(spec.global_shape)
        if joined_shape(src, spec) != want:
            raise ConfigError(f"import-megatron: {name} is {list(joined_shape(src, spec))} in {ckpt.folder}, its args "
                              f"imply {list(want)}; the tensors do not match the args")
        out[name] = (want, src.dtype, lambda src=src, spec=spec: join_shards([f() for f in src.loaders], spec))
    return out


def import_megatron(megatron_dir: str, output: str, iteration: Optional[int] = None) -> tuple[Path, list]:
    """A Megatron-LM checkpoint as a checkpoint to train from (`offline.save_streamed`: iteration 0, each tensor in
    its saved dtype, one at a time). The saved config holds the model of the checkpoint's ``args``
    (`mptrain.megatron_ckpt.args.model_from_args`), ``data.tokenizer`` where mptrain reads Megatron's, and
    ``use_checkpoint_args``: ``checkpoint.load=<output>`` makes the model at any layout.

    Args:
        megatron_dir: Megatron's ``--save`` folder (``latest_checkpointed_iteration.txt``) or one ``iter_N`` folder.
        output: a new or empty folder.
        iteration: which ``iter_N`` (default: the tracker's).
    Returns:
        (the checkpoint folder, notes: what is not carried).
    Raises:
        ConfigError: no checkpoint, an unsupported format or argument, tensors that do not match the args, an
            ``output`` in use (one line each).
    """
    ckpt = read_checkpoint(megatron_dir, iteration)
    notes = [FRESH + (f"; Megatron's iteration {ckpt.iteration} is recorded in meta.json" if ckpt.iteration else "")]
    model = model_from_args(ckpt.args, vocab_size=vocab_rows(ckpt.tensors), where=ckpt.args_file)
    tensors = _tensors(ckpt, model)
    root = Path(output)
    offline.check_new_output(root, "import-megatron")
    root.mkdir(parents=True, exist_ok=True)
    config = {"model": model, "checkpoint": {"use_checkpoint_args": True}}
    tokenizer = tokenizer_from_args(ckpt.args, notes)
    config.update({"data": {"tokenizer": tokenizer}} if tokenizer else {})
    record = {"format": ckpt.format, "iteration": ckpt.iteration, "checkpoint_version": ckpt.checkpoint_version,
              **ckpt.layout}
    folder = offline.save_streamed(root, tensors, config=config,
                                   extra={"imported_from": str(ckpt.folder), "megatron": record})
    return folder, notes
