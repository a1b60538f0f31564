"""`save_checkpoint` / `maybe_load_checkpoint`: what the training side calls (DESIGN.md §4).

Both take this rank's `mptrain.checkpoint.state.TrainState` (model chunks, optimizer wrapper: its
state, loss scaler and skip counters come from its ``sharded_state_dict()``, LR scheduler, RNG
tracker, iteration and consumed samples), the resolved config (``checkpoint.*``, ``train.seed``,
``precision.name``, ``data.tokenizer``; saved whole in the checkpoint) and the `ParallelGroups`;
optionally a ``log(text, *, console=True)`` callable. Nothing of the training loop comes in: an
async save is the caller's thread running `mptrain.checkpoint.writer.write_and_publish` on what
`capture_save` captured (`mptrain.training.checkpointing`), and a fault site is a plain callable.

Keys and what they hold: `mptrain.checkpoint.state`; addressing by global unpadded shape + offsets:
`mptrain.checkpoint.reshard`; the DCP planners: `mptrain.checkpoint.dcp_io`; the write, checksums
and publication: `mptrain.checkpoint.writer`; folders / ``latest`` / pruning:
`mptrain.checkpoint.atomic`; RNG: `mptrain.checkpoint.rng`. Megatron's counterparts:
``training/checkpointing.py::save_checkpoint`` / ``load_checkpoint`` with the ``torch_dist`` format.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from mptrain.checkpoint import atomic, integrity, rng
from mptrain.checkpoint.args import meta_with_tokenizer_beside
from mptrain.checkpoint.reshard import check_coverage
from mptrain.checkpoint.state import (
    TrainState,
    model_chunks,
    optimizer_load_items,
    optimizer_save_items,
    param_records,
    resolve_optimizer_state,
)
from mptrain.config.schema import config_to_container
from mptrain.errors import ConfigError, StorageError
from mptrain.precision.module import unwrap
from mptrain.precision.optimizer import WrapperState

if TYPE_CHECKING:
    from mptrain.checkpoint.writer import PendingSave
    from mptrain.groups import ParallelGroups

FORMAT = "mptrain-dcp-1"
# Model-config keys that decide parameter shapes (listed in the mismatch error when they differ).
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
              "vocab_size", "max_position_embeddings", "seq_length", "normalization", "activation",
              "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear")
MISMATCH_NAMES_SHOWN = 3  # tensor names per kind of mismatch in the one-line error

Log = Callable[..., None]
"""``log(text, *, console=True)``: a checkpoint line for the run's log (``console=False``: train.log only)."""


def _dcp_io():
    """`mptrain.checkpoint.dcp_io`, imported at first use: torch.distributed.checkpoint imports DTensor, 0.5 s
    of every process's start-up that only runs which save or load need."""
    from mptrain.checkpoint import dcp_io

    return dcp_io


def _log(log: Optional[Log], msg: str, *, console: bool = True) -> None:
    if log is not None:
        log(msg, console=console)


def config_dict(cfg: Any) -> dict:
    """The resolved config as plain data (a `Config` dataclass or a DictConfig)."""
    if dataclasses.is_dataclass(cfg):
        return config_to_container(cfg)  # dataclasses.asdict would drop the keys added with `+`
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def _vocab_size(chunks: list) -> int:
    return int(unwrap(chunks[0]).vocab_size)


def _param_dtype(chunks: list) -> str:
    for p in unwrap(chunks[0]).parameters():
        return str(p.dtype).replace("torch.", "")
    return "float32"


def _common_state(state: TrainState, optimizer_state: WrapperState, cfg: Any, groups: ParallelGroups) -> dict:
    """The ``common`` object; the wrapper's loss scaler and skip counters (``optimizer_state``) are saved here."""
    return {
        "format": FORMAT,
        "iteration": int(state.iteration),
        "consumed_samples": int(state.consumed_samples),
        "scaler": optimizer_state.scaler,
        "lr_scheduler": state.lr_scheduler.state_dict(),
        "counters": {k: int(v) for k, v in (optimizer_state.counters or {}).items()},
        "layout": rng.layout_of(groups),
        "vocab_size": _vocab_size(state.chunks),
        "param_dtype": _param_dtype(state.chunks),
        "config": config_dict(cfg),
        "torch_version": torch.__version__,
    }


def capture_save(state: TrainState, *, cfg: Any, groups: ParallelGroups) -> Optional[PendingSave]:
    """This rank's part of checkpoint ``state.iteration`` in ``cfg.checkpoint.save``, by reference: views of
    the live tensors (`mptrain.checkpoint.writer.stage_to_host` copies them for an async save) and the
    common object (iteration, consumed samples, loss scaler, LR scheduler, skip counters, layout, config).
    No collective; None when ``checkpoint.save`` is null. Imports the writer (torch.distributed.checkpoint)
    on the calling thread."""
    from mptrain.checkpoint.writer import PendingSave

    root = cfg.checkpoint.save
    if not root:
        return None
    records = param_records(state.chunks)
    optimizer_state = state.optimizer.sharded_state_dict()  # the wrapper lists its state: saved here only
    opt_chunks, objects = optimizer_save_items(optimizer_state, records)
    objects["common"] = _common_state(state, optimizer_state, cfg, groups)
    objects[rng.rng_key(groups)] = rng.capture(state.rng_tracker)
    return PendingSave(root=str(root), iteration=int(state.iteration), chunks=model_chunks(records) + opt_chunks,
                       objects=objects, keep_last_n=cfg.checkpoint.keep_last_n, tokenizer=cfg.data.tokenizer)


def save_checkpoint(state: TrainState, *, cfg: Any, groups: ParallelGroups, log: Optional[Log] = None,
                    before_write: Optional[Callable[[], None]] = None) -> Optional[Path]:
    """Save iteration ``state.iteration`` to ``cfg.checkpoint.save``, blocking (collective on all ranks).

    Writes ``iter_<N>.tmp`` (DCP: model, main params, optimizer state; objects: common state and
    this rank's RNG) and its CRC32 manifest, then rank 0 renames it to ``iter_<N>``, rewrites
    ``latest`` and prunes beyond ``checkpoint.keep_last_n`` (`mptrain.checkpoint.writer`). Logs the
    line "checkpoint: saved iteration N to <folder>; training blocked X s". ``checkpoint.async_save``
    is the caller's: `capture_save`, then `mptrain.checkpoint.writer.stage_to_host` and
    `mptrain.checkpoint.writer.write_and_publish` in a thread of its own.

    Args:
        before_write: called once ``iter_N.tmp`` exists, before the DCP write (a fault site).
    Returns:
        the published folder (None when ``checkpoint.save`` is null).
    Raises:
        StorageError: a write failed on any rank (disk full, unwritable): raised on every rank, one
            line naming the folder, the cause and the fix (also logged, ``console=False``);
            ``iter_N.tmp`` is removed and the previous checkpoint and ``latest`` are untouched.
    """
    import time

    if not cfg.checkpoint.save:
        return None
    from mptrain.checkpoint.writer import write_and_publish  # torch.distributed.checkpoint: before the timing

    t0 = time.perf_counter()
    save = capture_save(state, cfg=cfg, groups=groups)
    try:
        message = write_and_publish(save, rank=groups.rank, world_size=groups.world_size, device=groups.device,
                                    before_write=before_write)
    except StorageError as err:
        _log(log, f"error: {err}", console=False)  # the console's copy: the entry point's one line
        raise
    _log(log, f"{message}; training blocked {time.perf_counter() - t0:.3f} s")
    return save.folder


def _verified_folder(root: str, folder: Path, cfg, groups, log: Optional[Log]) -> Path:
    """``folder`` when its files match its manifest; else (loading ``latest``) the newest intact older one.

    Collective (one all_gather per folder tried). Raises ConfigError naming the bad file when
    ``checkpoint.load_iteration`` was asked for, or when no intact checkpoint is left.
    """
    def gather(obj):
        out: list = [None] * groups.world_size
        dist.all_gather_object(out, obj)
        return out

    problem = integrity.verify_folder(folder, groups.rank, groups.world_size, gather)
    if problem is None:
        return folder
    if cfg.checkpoint.load_iteration is not None:
        raise ConfigError(f"checkpoint.load_iteration={cfg.checkpoint.load_iteration}: {problem}; load another "
                          f"iteration (or restore the file)")
    first_problem = problem
    for it in reversed([i for i in atomic.list_iterations(root) if i < int(folder.name.split("_")[1])]):
        candidate = Path(root) / atomic.iter_dir_name(it)
        problem = integrity.verify_folder(candidate, groups.rank, groups.world_size, gather)
        if problem is None:
            _log(log, f"checkpoint: {first_problem}; loading iteration {it}, the newest intact checkpoint")
            return candidate
    raise ConfigError(f"checkpoint.load={root}: {first_problem}, and no older checkpoint there is intact; restore "
                      "the file, or set checkpoint.load=null to start fresh")


def _row_mismatch_hints(saved: dict, wanted: dict) -> list:
    """The fix for a table whose rows alone differ (``saved``: ``model/<name>`` -> (shape, ...) of the
    checkpoint, ``wanted``: -> shape of the model): the vocabulary (word embedding, output layer) follows
    the tokenizer; the learned position embedding has ``model.max_position_embeddings`` rows."""

    def rows_differ(name: str):
        key = f"model/{name}"
        if key not in saved or key not in wanted:
            return None
        old, new = tuple(saved[key][0]), tuple(wanted[key])
        return old[0] if len(old) == len(new) == 2 and old[0] != new[0] and old[1:] == new[1:] else None

    hints = []
    if rows_differ("embedding.word_embeddings.weight") is not None or rows_differ("output_layer.weight") is not None:
        hints.append("the vocabulary (rows of the word embedding and output layer) follows data.tokenizer (or "
                     "model.vocab_size, padded to model.make_vocab_size_divisible_by): use the checkpoint's tokenizer "
                     "(checkpoint.use_checkpoint_args=true, or the same data.tokenizer)")
    rows = rows_differ("embedding.position_embeddings.weight")
    if rows is not None:
        hints.append(f"the position embedding has model.max_position_embeddings rows (null = model.seq_length): set "
                     f"model.max_position_embeddings={rows} (the checkpoint's) to load it at another model.seq_length")
    return hints


def _check_model_matches(folder: Path, records: list, tkeys: dict, groups, saved_cfg: dict, cfg) -> None:
    """ConfigError (on every rank) listing missing / unexpected / mismatched ``model/`` keys.

    Collective: the parameter names every rank needs are all-gathered, so a checkpoint with more
    layers than the model is caught too.
    """
    needed = {f"model/{r.ckpt_name}": tuple(r.spec.global_shape) for r in records}
    gathered: list = [None] * groups.world_size
    dist.all_gather_object(gathered, needed)
    wanted: dict = {}
    for part in gathered:
        wanted.update(part)
    saved = {k: v for k, v in tkeys.items() if k.startswith("model/")}
    missing = sorted(k for k in wanted if k not in saved)
    unexpected = sorted(k for k in saved if k not in wanted)
    mismatched = sorted(f"{k} (checkpoint {list(saved[k][0])}, model {list(wanted[k])})"
                        for k in wanted if k in saved and tuple(saved[k][0]) != tuple(wanted[k]))
    incomplete = [m for k in wanted if k in saved for m in [check_coverage(k, *saved[k])] if m]
    if not (missing or unexpected or mismatched or incomplete):
        return
    saved_model = saved_cfg.get("model", {})
    now = (cfg if isinstance(cfg, dict) else config_dict(cfg)).get("model", {})
    diffs = [f"model.{k}={saved_model.get(k)!r} in the checkpoint vs {now.get(k)!r}" for k in SHAPE_KEYS
             if k in saved_model and saved_model.get(k) != now.get(k)]
    parts = []
    for title, keys in (("shape mismatch", mismatched), ("missing from the checkpoint", missing),
                        ("not in the model", unexpected), ("incomplete", incomplete)):
        if keys:  # a few names show the kind of mismatch; the config keys above say its cause
            shown = ", ".join(k.removeprefix("model/") for k in keys[:MISMATCH_NAMES_SHOWN])
            more = len(keys) - MISMATCH_NAMES_SHOWN
            parts.append(f"{title}: {shown}" + (f" (+{more} more)" if more > 0 else ""))
    err = ConfigError(
        f"checkpoint.load: {folder} holds a different model"
        + (f": {', '.join(diffs)}" if diffs else "") + "; " + "; ".join(parts)
        + "".join(f"; {hint}" for hint in _row_mismatch_hints(saved, wanted))
        + "; load it with the model it was saved with (checkpoint.use_checkpoint_args=true builds it), or set "
          "checkpoint.load=null to start fresh"
    )
    err.symmetric = True  # made of the gathered names: the same line on every rank, rank 0 prints it
    raise err


def maybe_load_checkpoint(state: TrainState, *, cfg: Any, groups: ParallelGroups, log: Optional[Log] = None) -> None:
    """Load ``cfg.checkpoint.load`` (its ``latest``, or ``checkpoint.load_iteration``) into ``state``, in place.

    Restores the model chunks, fp32 main params, optimizer state, loss scaler, skip counters (through
    the optimizer wrapper), LR scheduler, this rank's RNG states (or re-derives them when the layout
    changed; the log says so), ``state.iteration`` and ``state.consumed_samples``. Any TP / PP / DP /
    distributed-optimizer / precision layout loads (resharding). ``checkpoint.finetune`` loads the
    weights only (iteration 0, everything else as the caller made it); ``checkpoint.load_optim=false``
    skips the optimizer state and the loss scaler; ``checkpoint.load_rng=false`` re-derives the RNG
    states (`mptrain.checkpoint.finetune`). Collective on all ranks.

    ``state.iteration`` and ``state.consumed_samples`` are 0 afterwards when ``checkpoint.load`` is null,
    holds no checkpoint, or ``checkpoint.finetune`` is set.

    Raises:
        ConfigError: the checkpoint holds a different model (keys and shapes listed),
            ``checkpoint.load_iteration`` names no complete checkpoint, or the optimizer class or
            its state shapes changed while ``checkpoint.load_optim`` is true.
    """
    from mptrain.checkpoint.finetune import optimizer_change

    state.iteration, state.consumed_samples = 0, 0  # what a fresh start or a fine-tune begins from
    root = cfg.checkpoint.load
    if not root:
        return
    finetune = bool(getattr(cfg.checkpoint, "finetune", False))
    load_optim = bool(getattr(cfg.checkpoint, "load_optim", True)) and not finetune
    load_rng = bool(getattr(cfg.checkpoint, "load_rng", True)) and not finetune
    try:
        folder, note = atomic.resolve_load_dir(root, cfg.checkpoint.load_iteration)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    if note:
        _log(log, note)
    if folder is None:
        if finetune:  # fine-tuning from nothing is a mistake, not a fresh start
            raise ConfigError(f"checkpoint.finetune=true: checkpoint.load={root} holds no complete checkpoint; "
                              "point checkpoint.load at the checkpoint to fine-tune from")
        _log(log, f"checkpoint: nothing to load in {root}; starting from iteration 0")
        return
    folder = _verified_folder(root, folder, cfg, groups, log)  # checksums (checkpoint/integrity.py)
    dcp_io = _dcp_io()
    metadata = dcp_io.read_metadata(str(folder))
    tkeys = dcp_io.tensor_keys(metadata)
    okeys = set(dcp_io.object_keys(metadata))
    meta = atomic_meta(folder)
    records = param_records(state.chunks)
    _check_model_matches(folder, records, tkeys, groups, meta.get("config", {}), cfg)
    optimizer = state.optimizer
    change = optimizer_change(optimizer.optimizer, meta.get("config", {}), config_dict(cfg), tkeys, okeys)
    if change and load_optim:
        err = ConfigError(f"checkpoint.load: {folder}: optimizer changed ({change}); set checkpoint.load_optim=false "
                          "to resume with a fresh optimizer state, checkpoint.finetune=true to start a new run from "
                          "the weights, or select the checkpoint's optimizer (optim / optim._target_)")
        err.symmetric = True  # the configs' optimizer class and the checkpoint's keys: alike on every rank
        raise err
    chunks = model_chunks(records, tensor_keys=set(tkeys))
    optimizer_state = optimizer.sharded_state_dict()
    opt_chunks, opt_objects = optimizer_load_items(optimizer_state, records, set(tkeys), okeys)
    if not load_optim:  # keep the main-param fills (they are weights); drop the optimizer state
        opt_chunks = [c for c in opt_chunks if not c.key.startswith("optim/")]
        opt_objects = []
    my_rng = rng.rng_key(groups)
    want = ["common"] + opt_objects + ([my_rng] if (load_rng and my_rng in okeys) else [])
    with torch.no_grad():
        objects = dcp_io.load_chunks(str(folder), chunks + opt_chunks, want)
    common = objects["common"]
    saved_layout = common.get("layout", {})
    where = (f"from {folder}, saved at tp{saved_layout.get('tp')} pp{saved_layout.get('pp')} "
             f"dp{saved_layout.get('dp')}")
    if finetune:
        _log(log, f"checkpoint: fine-tuning from the weights of iteration {common['iteration']} {where} "
                  "(checkpoint.finetune=true): iteration 0, fresh optimizer, loss scaler, LR schedule and data order")
        return
    counters = common.get("counters", {})
    if load_optim:
        resolve_optimizer_state(optimizer_state, objects)
        if optimizer_state.scaler is not None and common.get("scaler") is None:
            _log(log, "checkpoint: no loss-scaler state saved (fp32/bf16 checkpoint); keeping the initial scale")
        optimizer.load_sharded_state_dict(WrapperState(params=optimizer_state.params, scaler=common.get("scaler"),
                                                       counters=counters))
    else:
        _log(log, "checkpoint: optimizer state and loss scaler not loaded (checkpoint.load_optim=false); "
                  + (f"{change}; " if change else "") + "they start fresh")
        optimizer.load_sharded_state_dict(WrapperState(counters=counters))  # the skip counts belong to the run
    state.lr_scheduler.load_state_dict(common["lr_scheduler"])
    iteration = int(common["iteration"])
    if load_rng:
        reason = rng.restore_or_rederive(objects.get(my_rng), common.get("layout", {}), seed=cfg.train.seed,
                                         iteration=iteration, groups=groups, rng_tracker=state.rng_tracker)
    else:
        rng.rederive(cfg.train.seed, iteration, groups, state.rng_tracker)
        reason = "checkpoint.load_rng=false"
    if reason is not None:
        _log(log, f"checkpoint: RNG states re-derived from train.seed={cfg.train.seed}, iteration {iteration} "
                  f"and each rank's (tp, pp, dp) coordinates: {reason}")
    saved_precision = meta.get("config", {}).get("precision", {}).get("name")
    if saved_precision is not None and saved_precision != cfg.precision.name:  # e.g. bf16 <-> fp8: a compute mode
        _log(log, f"checkpoint: precision changed {saved_precision} -> {cfg.precision.name} (weights and optimizer "
                  "state load as saved: fp32 main params)")
    _log(log, f"checkpoint: loaded iteration {iteration} (consumed_samples {common['consumed_samples']}) {where}")
    state.iteration, state.consumed_samples = iteration, int(common["consumed_samples"])


def load_model_weights(folder: Path, chunks: list, groups, saved_cfg: dict) -> None:
    """Fill ``chunks`` (raw model chunks of any layout) with the weights of checkpoint ``folder``.

    What `maybe_load_checkpoint` does for the model alone (fp32 params read the fp32 main params
    when the checkpoint has them), for callers without an optimizer (`mptrain.generate`).
    Collective on the default group.

    Raises:
        ConfigError: the checkpoint holds a different model (keys and shapes listed).
    """
    dcp_io = _dcp_io()
    metadata = dcp_io.read_metadata(str(folder))
    tkeys = dcp_io.tensor_keys(metadata)
    records = param_records(chunks)
    _check_model_matches(folder, records, tkeys, groups, saved_cfg, saved_cfg)
    with torch.no_grad():
        dcp_io.load_chunks(str(folder), model_chunks(records, tensor_keys=set(tkeys)), [])


def atomic_meta(folder: Path, *, required: bool = False) -> dict:
    """meta.json of a checkpoint folder, its saved ``data.tokenizer`` file found beside the checkpoint when
    the recorded path is gone (`mptrain.checkpoint.args.meta_with_tokenizer_beside`). The one reader of
    meta.json: `mptrain.checkpoint.offline.atomic_meta` is this with ``required=True``.

    Returns:
        the contents; {} when unreadable and not ``required`` (the loader reports what is wrong).
    Raises:
        OSError, ValueError: unreadable (missing, not JSON), with ``required``.
    """
    try:
        meta = json.loads((Path(folder) / atomic.META_FILE).read_text())
    except (OSError, ValueError):
        if required:
            raise
        return {}
    return meta_with_tokenizer_beside(meta, folder)


__all__ = ["TrainState", "capture_save", "save_checkpoint", "maybe_load_checkpoint", "load_model_weights", "FORMAT",
           "config_dict"]
