"""The model a checkpoint was saved with, as the run's model (Megatron's ``--use-checkpoint-args``).

``checkpoint.use_checkpoint_args`` (null = what the checkpoint says: true for one written by
``python -m mptrain.export --import-hf``, and for one saved by a run that took its model this way)
makes `apply_checkpoint_args` copy, from ``checkpoint.load``'s saved config, the model's architecture
keys (`ARCHITECTURE_KEYS`: everything the weights' shapes and math depend on) and ``data.tokenizer``
over the composed config, before validation. Training choices stay the run's: ``seq_length``,
dropout, recomputation, compile, the attention backend. Megatron-LM: ``load_args_from_checkpoint``
(megatron/training/checkpointing.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mptrain.checkpoint import atomic

ARCHITECTURE_KEYS = (
    "name", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
    "max_position_embeddings", "vocab_size", "untie_embeddings_and_output_weights", "normalization",
    "layernorm_epsilon", "activation", "position_embedding_type", "rotary_base", "rope_scaling", "rope_scaling_factor",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "add_bias_linear", "add_qkv_bias",
)
"""``model.*`` keys taken from the checkpoint (Megatron's list, less its training choices)."""


def apply_checkpoint_args(cfg):
    """``cfg`` (a `mptrain.config.schema.Config`) with the checkpoint's architecture and tokenizer, when
    ``checkpoint.use_checkpoint_args`` is true, or null and the checkpoint asks for it (module docstring).

    The tokenizer file an import recorded is looked up beside the checkpoint when its recorded path is
    gone (a moved or copied checkpoint folder).

    Pure but for reading ``meta.json`` of the folder ``checkpoint.load`` resolves to; a load folder
    without a checkpoint (or none) leaves ``cfg`` as is (the loader reports what is wrong).
    Returns the same object, updated in place, with ``checkpoint.use_checkpoint_args`` resolved.
    """
    ck = cfg.checkpoint
    if not ck.load or ck.use_checkpoint_args is False:
        return cfg
    try:
        folder, _ = atomic.resolve_load_dir(str(ck.load), ck.load_iteration)
    except FileNotFoundError:
        return cfg
    if folder is None:
        return cfg
    try:
        saved = json.loads((folder / atomic.META_FILE).read_text()).get("config", {})
    except (OSError, ValueError):
        return cfg
    wanted = ck.use_checkpoint_args
    if wanted is None:
        wanted = bool((saved.get("checkpoint") or {}).get("use_checkpoint_args"))
    if not wanted:
        return cfg
    model = saved.get("model") or {}
    updates = {k: model[k] for k in ARCHITECTURE_KEYS if k in model}
    cfg.model = dataclasses.replace(cfg.model, **updates)
    tokenizer = (saved.get("data") or {}).get("tokenizer")
    if tokenizer:
        tokenizer = dict(tokenizer)
        path, beside = tokenizer.get("tokenizer_json"), folder.parent / "tokenizer.json"
        if path and not Path(path).is_file() and beside.is_file():  # the folder was moved: its own copy
            tokenizer["tokenizer_json"] = str(beside.resolve())
        cfg.data.tokenizer = tokenizer
    ck.use_checkpoint_args = True  # saved with the run's config: its own checkpoints pass the model on
    return cfg
