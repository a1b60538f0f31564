"""The model a checkpoint was saved with, as the run's model (Megatron's ``--use-checkpoint-args``).

``checkpoint.use_checkpoint_args`` (null = what the checkpoint says: true for one written by
``python -m mptrain.export --import-hf`` or ``--import-megatron``, and for one saved by a run that took its
model this way) makes `apply_checkpoint_args` copy, from ``checkpoint.load``'s saved config, the model's architecture
keys (`ARCHITECTURE_KEYS`: everything the weights' shapes and math depend on), ``data.tokenizer`` and
``checkpoint.hf_config`` (what an import read from the Hugging Face config.json and an export writes
back) over the composed config, before validation. Training choices stay the run's: ``seq_length``,
dropout, recomputation, compile, the attention backend. A ``data.tokenizer`` given on the command line
(``data.tokenizer._target_=...`` or the whole node) wins over the checkpoint's, with one warning (rank 0)
when they differ: the tokenizer is data, not architecture, as in Megatron, whose ``tokenizer_type`` is
taken from the checkpoint only when the command line left it unset; ``data.tokenizer.KEY=...`` alone
edits the checkpoint's tokenizer (`command_line_tokenizer`). Megatron-LM:
``load_args_from_checkpoint`` (megatron/training/checkpointing.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from mptrain.checkpoint import atomic

ARCHITECTURE_KEYS = (
    "name", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
    "max_position_embeddings", "vocab_size", "untie_embeddings_and_output_weights", "normalization",
    "layernorm_epsilon", "activation", "position_embedding_type", "rotary_base", "rope_scaling", "rope_scaling_factor",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "apply_layernorm_1p", "rotary_percent",
    "num_moe_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
)
"""``model.*`` keys taken from the checkpoint (Megatron's list, less its training choices)."""
HF_CONFIG_KEYS = ("model_type", "bos_token_id", "eos_token_id")
"""``checkpoint.hf_config`` keys: the Hugging Face config.json values an import records for the export."""

logger = logging.getLogger(__name__)


def command_line_keys(command_line: Optional[Sequence[str]] = None) -> set:
    """The config keys the command line set: ``command_line`` (Hydra override strings such as
    ``data.tokenizer.eod_token=</s>`` or ``+x.y=1``), else Hydra's task overrides of the running app;
    empty outside a Hydra app (a config composed by code)."""
    if command_line is None:
        from hydra.core.hydra_config import HydraConfig

        command_line = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    return {str(o).split("=", 1)[0].lstrip("+~") for o in command_line}


def _given(keys: set, node: str) -> bool:
    """``node`` or a key under it was set on the command line."""
    return any(k == node or k.startswith(node + ".") for k in keys)


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


TOKENIZER_COPY = "tokenizer.json"
"""The copy of an HFTokenizer's file kept in a ``checkpoint.save`` folder (beside ``latest``), written by
an import and by every save, so a checkpoint still decodes when the file it was trained with moved."""


TOKENIZER_SIDECARS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""The Hugging Face files that describe a ``tokenizer.json`` beside it in its folder (chat template, model_max_length,
added special tokens, ...): kept with the copy (`keep_tokenizer_copy`, the import), and the base of an export's
own files (`mptrain.hf.tokenizer.write_tokenizer_files`)."""


def tokenizer_beside(tokenizer: Optional[dict], folder: Path) -> Optional[dict]:
    """``tokenizer`` (a saved ``data.tokenizer``) with its ``tokenizer_json`` replaced by the checkpoint's own
    copy (`TOKENIZER_COPY` in the parent of the ``iter_N`` ``folder``) when the recorded path is no file
    (a moved folder, or a relative path read from another directory); as is otherwise."""
    path = (tokenizer or {}).get("tokenizer_json")
    beside = Path(folder).parent / TOKENIZER_COPY
    if path and not Path(path).is_file() and beside.is_file():
        return {**tokenizer, "tokenizer_json": str(beside.resolve())}
    return tokenizer


def meta_with_tokenizer_beside(meta: dict, folder: Path) -> dict:
    """meta.json's content with `tokenizer_beside` applied to its saved ``data.tokenizer``."""
    data = (meta.get("config") or {}).get("data") or {}
    if not data.get("tokenizer"):
        return meta
    return {**meta, "config": {**meta["config"], "data": {**data, "tokenizer": tokenizer_beside(data["tokenizer"],
                                                                                               folder)}}}


def _copy_if_changed(src: Path, dst: Path) -> None:
    """``src`` to ``dst`` unless an identical file is there, through a temporary file and a rename (a reader
    sees the old copy or the new one). Raises OSError."""
    data = src.read_bytes()
    if dst.is_file() and dst.read_bytes() == data:
        return
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(dst)


def keep_tokenizer_copy(tokenizer: Any, root: Path) -> None:
    """Copy the run's ``data.tokenizer.tokenizer_json`` (when it names a file) to ``root``/`TOKENIZER_COPY`
    unless an identical copy is there, with the `TOKENIZER_SIDECARS` beside that file (one the file's folder
    lacks is removed from ``root``: it described another tokenizer): rank 0, at save, before ``latest``
    moves. Raises OSError."""
    path = _plain(tokenizer).get("tokenizer_json") if tokenizer else None
    if not path or not Path(path).is_file():
        return
    root = Path(root)
    _copy_if_changed(Path(path), root / TOKENIZER_COPY)
    source = Path(path).parent
    if source.resolve() == root.resolve():
        return  # the run's file is the checkpoint's own copy (training from an import into its folder)
    for name in TOKENIZER_SIDECARS:
        if (source / name).is_file():
            _copy_if_changed(source / name, root / name)
        else:
            (root / name).unlink(missing_ok=True)


def _warn_once(msg: str, *args: Any) -> None:
    """``logger.warning`` on the job's rank 0 only (`mptrain.errors.launch_rank_and_world`): the start-up
    check runs on every rank, before any process group, and a warning is said once per job."""
    from mptrain.errors import launch_rank_and_world

    if launch_rank_and_world()[0] == 0:
        logger.warning(msg, *args)


def _same_file(a: Any, b: Any) -> bool:
    """Two tokenizer file paths name the same file or files of equal bytes (the checkpoint's copy)."""
    if a == b:
        return True
    try:
        return Path(str(a)).expanduser().read_bytes() == Path(str(b)).expanduser().read_bytes()
    except (OSError, TypeError):
        return False


def same_tokenizer(a: dict, b: dict) -> bool:
    """Two ``data.tokenizer`` dicts build the same tokenizer: equal keys and values, ``tokenizer_json``
    compared by content (the checkpoint's copy and the file it was made from are one tokenizer)."""
    if not isinstance(a, dict) or not isinstance(b, dict) or set(a) != set(b):
        return False
    return all(_same_file(a[k], b[k]) if k == "tokenizer_json" else a[k] == b[k] for k in a)


def command_line_tokenizer(run: dict, saved: dict, given: set) -> dict:
    """The run's ``data.tokenizer`` when the command line set some of it and the checkpoint has ``saved``.

    - ``data.tokenizer.KEY=...`` keys without ``data.tokenizer._target_`` (nor the whole node) edit the
      checkpoint's tokenizer: ``saved`` with those keys (``~data.tokenizer.KEY`` removes one). A key the
      checkpoint's tokenizer class does not take (``data.tokenizer.vocab_size`` for an `HFTokenizer`, whose
      vocabulary is its file's) is refused: the composed config's default tokenizer would otherwise
      replace the checkpoint's.
    - Otherwise the command line's tokenizer (``run``); when it is the checkpoint's class on the same file
      (by content) without an ``eod_token``, the checkpoint's ``eod_token`` (an import's: the model's EOS)
      is kept, as the one recorded with the weights, instead of the class default.

    Raises:
        ConfigError: a key the checkpoint's tokenizer does not take (one line naming it and the fix).
    """
    from mptrain.components import accepted_keywords, import_target
    from mptrain.errors import ConfigError

    if not isinstance(run, dict):  # data.tokenizer=null or a string: the start-up check names the fix
        return run
    keys = {k[len("data.tokenizer."):] for k in given if k.startswith("data.tokenizer.")}
    if "data.tokenizer" not in given and "_target_" not in keys:
        target = saved.get("_target_")
        try:
            accepted = accepted_keywords(import_target("data.tokenizer", target))
        except ConfigError:
            accepted = None  # not importable here: building it reports that
        for key in sorted(keys):
            top = key.split(".")[0]
            if accepted is not None and top not in accepted and top in run:  # a removal (~KEY) of it is moot
                raise ConfigError(
                    f"data.tokenizer.{key}: the tokenizer comes from checkpoint.load ({target}, "
                    f"checkpoint.use_checkpoint_args), which takes no {top!r} (it accepts: "
                    f"{', '.join(sorted(accepted - {'self'})) or '(none)'}); drop data.tokenizer.{key} (model.vocab_size "
                    "sets the model's vocabulary), or replace the tokenizer: data.tokenizer._target_=... with its keys")
        merged = dict(saved)
        for key in {k.split(".")[0] for k in keys}:
            if key in run:
                merged[key] = run[key]
            else:
                merged.pop(key, None)
        return merged
    if (run.get("_target_") == saved.get("_target_") and "eod_token" not in run and "eod_token" in saved
            and run.get("tokenizer_json") and _same_file(run["tokenizer_json"], saved.get("tokenizer_json"))):
        return {**run, "eod_token": saved["eod_token"]}
    return run


def apply_checkpoint_args(cfg, command_line: Optional[Sequence[str]] = None):
    """``cfg`` (a `mptrain.config.schema.Config`) with the checkpoint's architecture, tokenizer and
    ``checkpoint.hf_config``, when ``checkpoint.use_checkpoint_args`` is true, or null and the checkpoint
    asks for it (module docstring).

    The tokenizer file an import recorded is looked up beside the checkpoint when its recorded path is
    gone (a moved or copied checkpoint folder). ``data.tokenizer`` and ``checkpoint.hf_config`` set on
    the command line (``command_line``: `command_line_keys`) stay the run's (``data.tokenizer.KEY`` alone
    edits the checkpoint's: `command_line_tokenizer`); a tokenizer that differs from the checkpoint's is
    logged as one warning naming both, by rank 0 (torchrun's ``RANK``) alone.

    Pure but for reading ``meta.json`` of the folder ``checkpoint.load`` resolves to; a load folder
    without a checkpoint (or none) leaves ``cfg`` as is (the loader reports what is wrong).
    Returns the same object, updated in place, with ``checkpoint.use_checkpoint_args`` resolved.

    Raises:
        ConfigError: a ``data.tokenizer.KEY`` the checkpoint's tokenizer does not take (one line).
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
        meta = json.loads((folder / atomic.META_FILE).read_text())
    except (OSError, ValueError):
        return cfg
    saved = meta.get("config", {})
    wanted = ck.use_checkpoint_args
    if wanted is None:
        wanted = bool((saved.get("checkpoint") or {}).get("use_checkpoint_args"))
    if not wanted:
        return cfg
    model = saved.get("model") or {}
    updates = {k: model[k] for k in ARCHITECTURE_KEYS if k in model}
    if updates.get("max_position_embeddings") is None and model.get("position_embedding_type") == "learned_absolute":
        # null meant the saved run's seq_length: the position table's rows, not this run's (a training choice)
        updates["max_position_embeddings"] = model.get("seq_length")
    given = command_line_keys(command_line)
    replaced = [f"model.{k}={getattr(cfg.model, k)} -> {v}" for k, v in updates.items()
                if _given(given, f"model.{k}") and getattr(cfg.model, k) != v]
    if replaced:  # the weights fix the architecture (Megatron's load_args_from_checkpoint); say so, once
        _warn_once("checkpoint.use_checkpoint_args: the checkpoint's architecture replaces the command line's "
                   "%s; set checkpoint.use_checkpoint_args=false to build the command line's model",
                   ", ".join(replaced))
    cfg.model = dataclasses.replace(cfg.model, **updates)
    tokenizer = (saved.get("data") or {}).get("tokenizer")
    other_tokenizer = False
    if tokenizer:
        tokenizer = dict(tokenizer_beside(tokenizer, folder))  # a moved folder: its own copy
        if not _given(given, "data.tokenizer"):
            cfg.data.tokenizer = tokenizer
        else:
            cfg.data.tokenizer = run = command_line_tokenizer(_plain(cfg.data.tokenizer), tokenizer, given)
            if not same_tokenizer(run, tokenizer):
                other_tokenizer = True
                _warn_once("checkpoint.use_checkpoint_args: checkpoint has data.tokenizer=%s, command line has %s; "
                           "using the command line's (the imported bos/eos ids are dropped: an export writes this "
                           "tokenizer's EOD)", tokenizer, run)
    # an import's record: in the saved config (checkpoint.hf_config), or meta.json's "hf" (older imports)
    hf = (saved.get("checkpoint") or {}).get("hf_config") or meta.get("hf")
    if hf and not _given(given, "checkpoint.hf_config"):
        ck.hf_config = {k: hf.get(k) for k in HF_CONFIG_KEYS}
        if other_tokenizer:  # those ids name tokens of the checkpoint's tokenizer, not of the run's
            ck.hf_config.update(bos_token_id=None, eos_token_id=None)
    ck.use_checkpoint_args = True  # saved with the run's config: its own checkpoints pass the model on
    return cfg
