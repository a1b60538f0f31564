"""The model of a Megatron-LM checkpoint, from its own ``args`` (the Namespace ``pretrain_gpt.py`` saved).

`model_from_args` maps the arguments to an mptrain ``model`` dict (Megatron's names are mptrain's keys,
DESIGN.md §1) and refuses, one line naming the argument, what mptrain's model cannot represent
(`UNSUPPORTED`). Argument names: Megatron-LM ``megatron/training/arguments.py``; since 0.14 every
``TransformerConfig`` field is an argument of its own name (``layernorm_epsilon`` for ``--norm-epsilon``,
``layernorm_zero_centered_gamma`` for ``--apply-layernorm-1p``), before that the flags' own dests: both are read.
"""

from __future__ import annotations

import os

from typing import Any, Optional

from mptrain.errors import ConfigError

_UNSET = object()


def arg(args: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``args`` has and is not None, else ``default``."""
    for name in names:
        value = getattr(args, name, _UNSET)
        if value is not _UNSET and value is not None:
            return value
    return default


def _on(v) -> bool:
    return bool(v)


def _set(v) -> bool:
    return v is not None


UNSUPPORTED: tuple = (
    # (argument, flag, is it in use?, what mptrain has instead)
    ("use_legacy_models", "--use-legacy-models", _on, "the pre-core model's checkpoint (language_model.* tensors); "
     "convert it to the core model first (Megatron-LM's tools/checkpoint/convert.py --saver core)"),
    ("position_embedding_type", "--position-embedding-type", lambda v: v not in ("learned_absolute", "rope"),
     "mptrain has learned_absolute and rope"),
    ("rotary_interleaved", "--rotary-interleaved", _on, "mptrain's RoPE rotates halves"),
    ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor", _set,
     "mptrain's RoPE has no position interpolation (llama3 scaling: --use-rope-scaling)"),
    ("no_rope_freq", "--no-rope-freq", _set, "mptrain applies RoPE in every layer"),
    ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm", _on,
     "mptrain's residuals skip the norm (pre-LN)"),
    ("qk_l2_norm", "--qk-l2-norm", _on, "mptrain's query / key norm is model.qk_layernorm's learned one"),
    ("num_experts", "--num-experts", _on, "mptrain has no mixture of experts yet"),
    ("multi_latent_attention", "--multi-latent-attention", _on, "mptrain has grouped-query attention only"),
    ("mtp_num_layers", "--mtp-num-layers", _on, "mptrain has no multi-token prediction"),
    ("openai_gelu", "--openai-gelu", _on, "mptrain's gelu is the exact (erf) one"),
    ("squared_relu", "--squared-relu", _on, "mptrain has gelu and swiglu"),
    ("quick_geglu", "--quick-geglu", _on, "mptrain has gelu and swiglu"),
    ("normalization", "--normalization", lambda v: v not in ("LayerNorm", "RMSNorm"), "mptrain has LayerNorm and RMSNorm"),
    ("window_size", "--window-size", _set, "mptrain has no sliding-window attention"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path", _set, "mptrain's layers are alike"),
    ("is_hybrid_model", "--hybrid-override-pattern", _on, "mptrain has no Mamba layers"),
    ("softmax_type", "--softmax-type", lambda v: v != "vanilla", "mptrain's attention softmax is the vanilla one"),
)
"""Megatron arguments whose use mptrain's model cannot represent (absent or None arguments are not in use)."""


def check_supported(args: Any, where: str) -> None:
    """Raises ConfigError (one line naming the first argument in use of `UNSUPPORTED`, and ``where`` it was read)."""
    for name, flag, used, instead in UNSUPPORTED:
        value = getattr(args, name, None)
        if value is not None and used(value):
            raise ConfigError(f"import-megatron: {where} was trained with {flag} ({name}={value!r}): {instead}; "
                              "the checkpoint cannot be imported")
    if arg(args, "layernorm_zero_centered_gamma", "apply_layernorm_1p", default=False) and args.normalization != "LayerNorm":
        raise ConfigError(f"import-megatron: {where} was trained with --apply-layernorm-1p and --normalization "
                          f"{args.normalization}: mptrain's zero-centred gamma is LayerNorm's only; the checkpoint cannot "
                          "be imported")
    rotary_base = arg(args, "rotary_base", default=10000)
    if float(rotary_base) != int(rotary_base):
        raise ConfigError(f"import-megatron: {where} has --rotary-base {rotary_base}: model.rotary_base is an integer; "
                          "the checkpoint cannot be imported")


def model_from_args(args: Any, *, vocab_size: int, where: str) -> dict:
    """The mptrain ``model`` dict of Megatron's ``args``.

    Args:
        args: the checkpoint's Namespace (or any object with those attributes).
        vocab_size: the rows of the saved word embedding: Megatron's ``padded_vocab_size``. Megatron trains the
            padded rows as real ones (its softmax covers them), so they are the imported model's vocabulary.
        where: the file ``args`` came from (for the error line).
    Raises:
        ConfigError: an argument of `UNSUPPORTED` in use, or a missing size (one line naming it).
    """
    check_supported(args, where)
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length") if arg(args, n) is None]
    if missing:
        raise ConfigError(f"import-megatron: {where} has no {', '.join(missing)} in its args; not a GPT checkpoint of "
                          "pretrain_gpt.py")
    h, heads = int(args.hidden_size), int(args.num_attention_heads)
    groups = arg(args, "num_query_groups") if arg(args, "group_query_attention", default=False) else None
    kv = arg(args, "kv_channels")
    swiglu = bool(arg(args, "swiglu", default=False))
    bias = bool(arg(args, "add_bias_linear", default=True))
    default_ffn = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h  # Megatron's validate_args

    def pick(*names: str, default: Any) -> Any:
        return arg(args, *names, default=default)

    return {
        "name": "megatron", "num_layers": int(args.num_layers), "hidden_size": h, "num_attention_heads": heads,
        "num_query_groups": None if groups in (None, heads) else int(groups),
        "ffn_hidden_size": int(pick("ffn_hidden_size", default=default_ffn)),
        "kv_channels": None if kv is None or int(kv) * heads == h else int(kv),
        "seq_length": int(args.seq_length),
        "max_position_embeddings": int(pick("max_position_embeddings", default=args.seq_length)),
        "vocab_size": int(vocab_size),
        "make_vocab_size_divisible_by": int(pick("make_vocab_size_divisible_by", default=128)),
        "untie_embeddings_and_output_weights": bool(pick("untie_embeddings_and_output_weights", default=False)),
        "hidden_dropout": float(pick("hidden_dropout", default=0.1)),
        "attention_dropout": float(pick("attention_dropout", default=0.1)),
        "init_method_std": float(pick("init_method_std", default=0.02)),
        "normalization": pick("normalization", default="LayerNorm"),
        "layernorm_epsilon": float(pick("layernorm_epsilon", "norm_epsilon", default=1e-5)),
        "apply_layernorm_1p": bool(pick("layernorm_zero_centered_gamma", "apply_layernorm_1p", default=False)),
        "activation": "swiglu" if swiglu else "gelu",
        "position_embedding_type": pick("position_embedding_type", default="learned_absolute"),
        "rotary_base": int(pick("rotary_base", default=10000)),
        "rotary_percent": float(pick("rotary_percent", default=1.0)),
        "rope_scaling": bool(pick("use_rope_scaling", default=False)),
        "rope_scaling_factor": float(pick("rope_scaling_factor", default=8.0)),
        "add_bias_linear": bias,
        "add_qkv_bias": bool(pick("add_qkv_bias", default=False)) and not bias,  # Megatron sets it with add_bias_linear
        "qk_layernorm": bool(pick("qk_layernorm", default=False)),  # q_layernorm / k_layernorm: our names, replicated
    }


def tokenizer_from_args(args: Any, notes: list) -> Optional[dict]:
    """The ``data.tokenizer`` node of Megatron's tokenizer, where mptrain reads the same one: GPT2BPETokenizer from the
    ``--vocab-file`` / ``--merge-file`` the checkpoint names, when both are on this machine (as ``python -m
    mptrain.from_megatron`` translates them). Any other, or files not found, is not carried: a line in ``notes``
    says which, and the run names its own."""
    kind = arg(args, "tokenizer_type")
    vocab, merges = arg(args, "vocab_file"), arg(args, "merge_file")
    if kind == "GPT2BPETokenizer" and vocab and merges and os.path.isfile(vocab) and os.path.isfile(merges):
        return {"_target_": "mptrain.data.tokenizers.GPT2BPETokenizer", "vocab_file": os.path.abspath(vocab),
                "merge_file": os.path.abspath(merges)}
    if kind is not None:
        model = arg(args, "tokenizer_model")
        files = f" --vocab-file {vocab} --merge-file {merges}" if kind == "GPT2BPETokenizer" else ""
        where = " (its files are not on this machine)" if files else ""
        notes.append(f"the tokenizer (--tokenizer-type {kind}{files}{f' --tokenizer-model {model}' if model else ''}) "
                     f"is not carried{where}: give the training run its data.tokenizer (docs/MEGATRON.md)")
    return None
