"""`save_checkpoint` / `maybe_load_checkpoint`: what the training loop calls (DESIGN.md §4).

Everything comes from the loop's ``built`` (`mptrain.training.run.Built`): ``cfg``, ``groups``,
``chunks`` (DDP wrappers), ``trainer.optimizer`` (any optimizer wrapper: its state, loss scaler and
skip counters come from its ``sharded_state_dict()``), ``trainer.lr_scheduler``, ``rng_tracker``. Keys and what they hold: `mptrain.checkpoint.state`; addressing by
global unpadded shape + offsets: `mptrain.checkpoint.reshard`; the DCP planners:
`mptrain.checkpoint.dcp_io`; folders / ``latest`` / pruning: `mptrain.checkpoint.atomic`; RNG:
`mptrain.checkpoint.rng`. Megatron's counterparts: ``training/checkpointing.py::save_checkpoint``
/ ``load_checkpoint`` with the ``torch_dist`` format.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from mptrain.checkpoint import atomic, integrity, rng
from mptrain.checkpoint.args import keep_tokenizer_copy, meta_with_tokenizer_beside
from mptrain.checkpoint.reshard import check_coverage
from mptrain.checkpoint.state import (
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

FORMAT = "mptrain-dcp-1"
FULL_DISK_BYTES = 1 << 20  # a failed save with less free space than this on checkpoint.save is reported as a full disk
# Model-config keys that decide parameter shapes (listed in the mismatch error when they differ).
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
              "vocab_size", "max_position_embeddings", "seq_length", "normalization", "activation",
              "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear")
MISMATCH_NAMES_SHOWN = 3  # tensor names per kind of mismatch in the one-line error


def _dcp_io():
    """`mptrain.checkpoint.dcp_io`, imported at first use: torch.distributed.checkpoint imports DTensor, 0.5 s
    of every process's start-up that only runs which save or load need."""
    from mptrain.checkpoint import dcp_io

    return dcp_io


def _log(recorder, msg: str, *, console: bool = True) -> None:
    if recorder is not None:
        recorder.log(msg, console=console)


def config_dict(cfg: Any) -> dict:
    """The resolved config as plain data (a `Config` dataclass or a DictConfig)."""
    if dataclasses.is_dataclass(cfg):
        return config_to_container(cfg)  # dataclasses.asdict would drop the keys added with `+`
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def _optimizer(built):
    return built.trainer.optimizer


def _vocab_size(built) -> int:
    return int(unwrap(built.chunks[0]).vocab_size)


def _param_dtype(built) -> str:
    for p in unwrap(built.chunks[0]).parameters():
        return str(p.dtype).replace("torch.", "")
    return "float32"


def _common_state(built, optimizer_state: WrapperState, iteration: int, consumed_samples: int) -> dict:
    """The ``common`` object; the wrapper's loss scaler and skip counters (``optimizer_state``) are saved here."""
    return {
        "format": FORMAT,
        "iteration": int(iteration),
        "consumed_samples": int(consumed_samples),
        "scaler": optimizer_state.scaler,
        "lr_scheduler": built.trainer.lr_scheduler.state_dict(),
        "counters": {k: int(v) for k, v in (optimizer_state.counters or {}).items()},
        "layout": rng.layout_of(built.groups),
        "vocab_size": _vocab_size(built),
        "param_dtype": _param_dtype(built),
        "config": config_dict(built.cfg),
        "torch_version": torch.__version__,
    }


def _all_ok(ok: bool, device, group=None) -> bool:
    """MIN over all ranks of a success flag (so a failure on rank 0 raises everywhere, never hangs)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _stage_to_cpu(chunks: list, objects: dict, buffers: dict) -> tuple[list, dict]:
    """Copies of every chunk view (on the host) and of the objects: what an async save writes while training
    goes on. The only part of an async save that blocks the loop (the device-to-host copy).

    Device tensors go into page-locked host buffers kept in ``buffers`` across saves (keyed by position,
    shape and dtype) and copied with one stream sync at the end: allocating and faulting in pageable
    memory at every save would block the loop many times longer
    (bench/reports/2026-12-01-micro-benchmarks.md). Reuse is safe: the previous save is waited for first."""
    import copy

    staged, on_device = [], False
    for i, c in enumerate(chunks):
        view = c.view.detach()
        if view.device.type == "cpu":
            host = view.clone()  # the loop keeps updating the params in place
        else:
            key = (i, tuple(view.shape), view.dtype)
            host = buffers.get(key)
            if host is None:
                host = buffers[key] = torch.empty(view.shape, dtype=view.dtype, pin_memory=True)
            host.copy_(view, non_blocking=True)
            on_device = True
        staged.append(dataclasses.replace(c, view=host))
    if on_device:
        torch.cuda.synchronize()  # the non-blocking copies above must land before the writer thread reads them
    return staged, copy.deepcopy(objects)


class AsyncSaves:
    """``checkpoint.async_save``: at most one save in flight, written by a background thread.

    The thread runs the same write + checksum + publish as a blocking save, over a gloo group of
    its own (created once, collectively, at the first async save) so that its collectives never
    interleave with the training loop's. `wait` (called before the next save, and by the loop
    before the job ends) joins it and re-raises its error on the main thread; ``latest`` is only
    rewritten by the thread, after every rank's files are written and checksummed.
    """

    def __init__(self) -> None:
        self.group = None
        self.buffers: dict = {}  # pinned host copies reused by every save (`_stage_to_cpu`)
        self.thread = None
        self.error: Optional[BaseException] = None
        self.message: Optional[str] = None

    def start(self, fn) -> None:
        import threading

        def target():
            try:
                self.message = fn()
            except BaseException as err:  # noqa: BLE001 - re-raised by wait() on the main thread
                self.error = err

        # daemon: a job failing with a save in flight must not hang at exit in that save's collectives (the
        # previous checkpoint stays the loadable one)
        self.thread = threading.Thread(target=target, name="mptrain-async-save", daemon=True)
        self.thread.start()

    def wait(self, recorder=None) -> None:
        if self.thread is None:
            return
        self.thread.join()
        self.thread = None
        error, message, self.error, self.message = self.error, self.message, None, None
        if error is not None:
            _log(recorder, f"error: {error}", console=False)  # the save thread could not log it
            raise error
        _log(recorder, message)


def wait_for_saves(built, recorder=None) -> None:
    """Block until a pending ``checkpoint.async_save`` is published (no-op otherwise). Collective-free."""
    saves = getattr(built, "async_saves", None)
    if saves is not None:
        saves.wait(recorder)


def save_checkpoint(built, *, iteration: int, consumed_samples: int, recorder=None) -> Optional[Path]:
    """Save iteration ``iteration`` to ``cfg.checkpoint.save`` (collective on all ranks).

    Writes ``iter_<N>.tmp`` (DCP: model, main params, optimizer state; objects: common state and
    this rank's RNG) and its CRC32 manifest, then rank 0 renames it to ``iter_<N>``, rewrites
    ``latest`` and prunes beyond ``checkpoint.keep_last_n`` (`mptrain.checkpoint.atomic`).

    With ``checkpoint.async_save``: the previous async save is waited for, the state is copied to
    host memory (the only blocking part), and a background thread does the rest
    (`AsyncSaves`); the returned folder is published once `wait_for_saves` returns.

    Returns:
        the (to be) published folder (None when ``checkpoint.save`` is null).
    Raises:
        StorageError: a write failed on any rank (disk full, unwritable): raised on every rank, one
            line naming the folder, the cause and the fix; ``iter_N.tmp`` is removed and the
            previous checkpoint and ``latest`` are untouched (async: raised by the next save or
            `wait_for_saves`).
    """
    cfg, groups = built.cfg, built.groups
    root = cfg.checkpoint.save
    if not root:
        return None
    import time

    _dcp_io()  # imported here, not in an async save's thread

    t0 = time.perf_counter()
    asynchronous = bool(getattr(cfg.checkpoint, "async_save", False))
    saves = None
    if asynchronous:
        saves = getattr(built, "async_saves", None)
        if saves is None:
            saves = built.async_saves = AsyncSaves()
            saves.group = dist.new_group(backend="gloo")  # collective, same point on every rank
        saves.wait(recorder)
    records = param_records(built.chunks)
    chunks = model_chunks(records)
    optimizer_state = _optimizer(built).sharded_state_dict()  # the wrapper lists its state: saved here only
    opt_chunks, objects = optimizer_save_items(optimizer_state, records)
    common = _common_state(built, optimizer_state, iteration, consumed_samples)
    objects["common"] = common
    objects[rng.rng_key(groups)] = rng.capture(built.rng_tracker)
    faults = getattr(built, "faults", None)  # the save_write fault site (mptrain.training.faults)
    chunks = chunks + opt_chunks
    folder = Path(root) / atomic.iter_dir_name(iteration)
    if not asynchronous:
        message = _write_and_publish(root, iteration, chunks, objects, common, cfg, groups.rank, groups.world_size,
                                     groups.device, None, faults, recorder)
        _log(recorder, f"{message}; training blocked {time.perf_counter() - t0:.3f} s")
        return folder
    chunks, objects = _stage_to_cpu(chunks, objects, saves.buffers)
    faults = dataclasses.replace(faults) if faults is not None else None  # its iteration frozen: the loop moves on
    saves.start(lambda: _write_and_publish(root, iteration, chunks, objects, objects["common"], cfg, groups.rank,
                                           groups.world_size, torch.device("cpu"), saves.group, faults, recorder))
    _log(recorder, f"checkpoint: iteration {iteration} copied to host memory, writing in the background; "
                   f"training blocked {time.perf_counter() - t0:.3f} s")
    return folder


def _write_and_publish(root, iteration, chunks, objects, common, cfg, rank, world_size, device, group, faults,
                       recorder) -> str:
    """The save proper (collective over ``group``): tmp folder, DCP write, checksums, meta + manifest, publish."""
    tmp = atomic.tmp_dir(root, iteration)
    ok, error = True, None
    if rank == 0:
        try:
            atomic.prepare_tmp(root, iteration)
        except OSError as err:
            ok, error = False, err
    if not _all_ok(ok, device, group):
        raise _save_error(root, iteration, tmp, error, recorder)
    if faults is not None:
        faults.maybe_fail("save_write")  # debug: die while iter_N.tmp is being written
    shards = None
    try:
        _dcp_io().save_chunks(str(tmp), chunks, objects, process_group=group)
        shards = integrity.own_shards(tmp, rank)  # this rank's files, checksummed in parallel
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException (a BaseException) holds every rank's error
        ok, error = False, err
    # DCP raises alike on every rank when one rank's write failed; the flag makes sure of it
    if not _all_ok(ok, device, group):
        raise _save_error(root, iteration, tmp, error, recorder)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, shards, group=group)
    removed = []
    if rank == 0:
        try:
            meta = {k: common[k] for k in ("format", "iteration", "consumed_samples", "layout", "vocab_size",
                                            "param_dtype", "torch_version")}
            meta["config"] = common["config"]
            atomic.write_json(tmp / atomic.META_FILE, meta)
            integrity.write_manifest(tmp, gathered)  # before the rename and `latest`
            keep_tokenizer_copy(cfg.data.tokenizer, Path(root))  # the checkpoint decodes without the run's file
            removed = atomic.publish(root, iteration, cfg.checkpoint.keep_last_n)
        except OSError as err:
            ok, error = False, err
    if not _all_ok(ok, device, group):
        raise _save_error(root, iteration, tmp, error, recorder)
    folder = Path(root) / atomic.iter_dir_name(iteration)
    return (f"checkpoint: saved iteration {iteration} to {folder}"
            + (f" (removed iterations {removed}: keep_last_n={cfg.checkpoint.keep_last_n})" if removed else ""))


def _root_oserror(err: BaseException) -> Optional[OSError]:
    """The OSError behind ``err`` (DCP's CheckpointException keeps each rank's exception in ``failures``)."""
    seen = 0
    stack = [err]
    while stack and seen < 50:
        e = stack.pop()
        seen += 1
        if isinstance(e, OSError):
            return e
        for inner in getattr(e, "failures", {}).values() if isinstance(getattr(e, "failures", None), dict) else ():
            stack.append(inner[0] if isinstance(inner, tuple) else inner)
        for inner in (getattr(e, "__cause__", None), getattr(e, "__context__", None)):
            if inner is not None:
                stack.append(inner)
    return None


def _save_error(root: str, iteration: int, tmp: Path, error: Optional[BaseException], recorder) -> StorageError:
    """Rank 0 removes ``iter_N.tmp``; every rank gets the same one-line `StorageError` (also in train.log).

    The message is built from what every rank knows (rank 0 alone prints it): the folder, the
    previous checkpoint, and the cause when this rank saw it.
    """
    import errno
    import shutil

    free = None
    try:  # before removing the .tmp: torch's zip writer hides ENOSPC ("unexpected pos ..."), the free space does not
        free = shutil.disk_usage(root).free
    except OSError:
        pass
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            Path(root, "latest.tmp").unlink(missing_ok=True)
        except OSError:  # root itself unusable (under a file, unreadable): the message below says so
            pass
    os_err = _root_oserror(error) if error is not None else None
    if (os_err is not None and os_err.errno == errno.ENOSPC) or (free is not None and free < FULL_DISK_BYTES):
        cause, fix = "no space left on device", "free space there or point checkpoint.save= at a folder with room"
    elif os_err is not None and os_err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause, fix = f"not writable ({os_err.strerror})", "fix its permissions or point checkpoint.save= elsewhere"
    elif os_err is not None:
        cause, fix = os_err.strerror or str(os_err), "check the storage or point checkpoint.save= elsewhere"
    else:
        cause, fix = "a write failed on another rank", "check that rank's storage or point checkpoint.save= elsewhere"
    previous = atomic.read_latest(root)
    kept = f"the previous checkpoint (iteration {previous}) is intact" if previous is not None else "no earlier checkpoint"
    msg = (f"checkpoint.save={root}: saving iteration {iteration} failed: {cause}; {tmp.name} removed and {kept}; "
           f"{fix}")
    import threading

    if threading.current_thread() is threading.main_thread():  # an async save's error is logged by `AsyncSaves.wait`
        _log(recorder, f"error: {msg}", console=False)  # the console's copy: the entry point's one line
    return StorageError(msg, all_ranks=True)


def _verified_folder(root: str, folder: Path, cfg, groups, recorder) -> Path:
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
            _log(recorder, f"checkpoint: {first_problem}; loading iteration {it}, the newest intact checkpoint")
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
    err.symmetric = True  # built from the gathered names: the same line on every rank, rank 0 prints it
    raise err


def maybe_load_checkpoint(built, recorder=None) -> dict:
    """Load ``cfg.checkpoint.load`` (its ``latest``, or ``checkpoint.load_iteration``) into ``built``.

    Restores model chunks, fp32 main params, optimizer state, loss scaler, LR scheduler, skip
    counters, and this rank's RNG states (or re-derives them when the layout changed; the log
    says so). Any TP / PP / DP / distributed-optimizer / precision layout loads (resharding).
    ``checkpoint.finetune`` loads the weights only (iteration 0, everything else as built);
    ``checkpoint.load_optim=false`` skips the optimizer state and the loss scaler;
    ``checkpoint.load_rng=false`` re-derives the RNG states (`mptrain.checkpoint.finetune`).
    Collective on all ranks.

    Returns:
        {"iteration": int, "consumed_samples": int} (zeros when ``checkpoint.load`` is null, holds
        no checkpoint, or ``checkpoint.finetune`` is set).
    Raises:
        ConfigError: the checkpoint holds a different model (keys and shapes listed),
            ``checkpoint.load_iteration`` names no complete checkpoint, or the optimizer class or
            its state shapes changed while ``checkpoint.load_optim`` is true.
    """
    from mptrain.checkpoint.finetune import optimizer_change

    cfg, groups = built.cfg, built.groups
    fresh = {"iteration": 0, "consumed_samples": 0}
    root = cfg.checkpoint.load
    if not root:
        return fresh
    finetune = bool(getattr(cfg.checkpoint, "finetune", False))
    load_optim = bool(getattr(cfg.checkpoint, "load_optim", True)) and not finetune
    load_rng = bool(getattr(cfg.checkpoint, "load_rng", True)) and not finetune
    try:
        folder, note = atomic.resolve_load_dir(root, cfg.checkpoint.load_iteration)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    if note:
        _log(recorder, note)
    if folder is None:
        if finetune:  # fine-tuning from nothing is a mistake, not a fresh start
            raise ConfigError(f"checkpoint.finetune=true: checkpoint.load={root} holds no complete checkpoint; "
                              "point checkpoint.load at the checkpoint to fine-tune from")
        _log(recorder, f"checkpoint: nothing to load in {root}; starting from iteration 0")
        return fresh
    folder = _verified_folder(root, folder, cfg, groups, recorder)  # checksums (checkpoint/integrity.py)
    dcp_io = _dcp_io()
    metadata = dcp_io.read_metadata(str(folder))
    tkeys = dcp_io.tensor_keys(metadata)
    okeys = set(dcp_io.object_keys(metadata))
    meta = atomic_meta(folder)
    records = param_records(built.chunks)
    _check_model_matches(folder, records, tkeys, groups, meta.get("config", {}), cfg)
    optimizer = _optimizer(built)
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
        _log(recorder, f"checkpoint: fine-tuning from the weights of iteration {common['iteration']} {where} "
                       "(checkpoint.finetune=true): iteration 0, fresh optimizer, loss scaler, LR schedule and data order")
        return fresh
    counters = common.get("counters", {})
    if load_optim:
        resolve_optimizer_state(optimizer_state, objects)
        if optimizer_state.scaler is not None and common.get("scaler") is None:
            _log(recorder, "checkpoint: no loss-scaler state saved (fp32/bf16 checkpoint); keeping the initial scale")
        optimizer.load_sharded_state_dict(WrapperState(params=optimizer_state.params, scaler=common.get("scaler"),
                                                       counters=counters))
    else:
        _log(recorder, "checkpoint: optimizer state and loss scaler not loaded (checkpoint.load_optim=false); "
                       + (f"{change}; " if change else "") + "they start fresh")
        optimizer.load_sharded_state_dict(WrapperState(counters=counters))  # the skip counts belong to the run
    built.trainer.lr_scheduler.load_state_dict(common["lr_scheduler"])
    iteration = int(common["iteration"])
    if load_rng:
        reason = rng.restore_or_rederive(objects.get(my_rng), common.get("layout", {}), seed=cfg.train.seed,
                                         iteration=iteration, groups=groups, rng_tracker=built.rng_tracker)
    else:
        rng.rederive(cfg.train.seed, iteration, groups, built.rng_tracker)
        reason = "checkpoint.load_rng=false"
    if reason is not None:
        _log(recorder, f"checkpoint: RNG states re-derived from train.seed={cfg.train.seed}, iteration {iteration} "
                       f"and each rank's (tp, pp, dp) coordinates: {reason}")
    saved_precision = meta.get("config", {}).get("precision", {}).get("name")
    if saved_precision is not None and saved_precision != cfg.precision.name:  # e.g. bf16 <-> fp8: a compute mode
        _log(recorder, f"checkpoint: precision changed {saved_precision} -> {cfg.precision.name} (weights and optimizer "
                       "state load as saved: fp32 main params)")
    _log(recorder, f"checkpoint: loaded iteration {iteration} (consumed_samples {common['consumed_samples']}) {where}")
    return {"iteration": iteration, "consumed_samples": int(common["consumed_samples"])}


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
    meta.json: `mptrain.export.atomic_meta` is this with ``required=True``.

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


__all__ = ["save_checkpoint", "maybe_load_checkpoint", "load_model_weights", "FORMAT", "config_dict"]
