"""Every DESIGN.md §5 config check, as one pure function run on every rank before any collective.

`validate_config(cfg, world_size)` reads only the config and the world size (no torch.distributed,
no files, no environment), so every rank reaches the same verdict and raises the same one-line
`ConfigError` before the first collective: no rank is left waiting in a collective that the others
never join. It returns the facts derived from the layout (`DerivedLayout`).

Decisions recorded here (beyond DESIGN.md):
- `schedule=gpipe` / `schedule=1f1b` with pipeline_model_parallel_size = 1 is accepted and
  degenerates to `no_pipelining` (Megatron's `get_forward_backward_func` does the same for pp = 1);
  `DerivedLayout.schedule` says so. `schedule=no_pipelining` with pp > 1 is an error.
- A virtual pipeline (vpp > 1) needs the interleaved schedule: `auto` picks it; an explicit
  `gpipe` / `1f1b` / `no_pipelining` with vpp > 1 is an error, as is `interleaved_1f1b` without vpp.
- `interleaved_1f1b` needs num_microbatches % pp == 0 (Megatron core_v0.5-0.9; with the default
  microbatch group size N = pp the newer rule is the same).
- `sequence_parallel=true` with tp = 1 is allowed and does nothing (`DerivedLayout.sequence_parallel`
  is False); with tp > 1 it needs seq_length % tp == 0 (activations are split along s).
- A loss scaler with fp32 / bf16 is allowed (it only multiplies the loss); fp16 without one is an error.
- Vocabulary checks need the tokenizer, so they are left to the caller: `check_vocab_size`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from mptrain.config.schema import Config
from mptrain.errors import ConfigError

MAX_TIMEOUT_S = 1e9  # train.timeout_s / step_timeout_s (~31 years): torch and gloo overflow far above

SCHEDULES = ("auto", "no_pipelining", "gpipe", "1f1b", "interleaved_1f1b")

# The option names the code dispatches on (registries elsewhere list the same names). A name not
# listed here is rejected before anything runs; adding a component means adding its name here too.
CHOICES: dict[str, tuple] = {
    "schedule.name": SCHEDULES,
    "precision.name": ("fp32", "bf16", "fp16"),
    "loss_scaler.name": ("auto", "dynamic", "constant", "none"),
    "optim.name": ("adam", "adamw", "sgd"),
    "optim.lr_decay_style": ("constant", "linear", "cosine"),
    "optim.impl": ("auto", "torch", "apex"),
    "data.name": ("mock", "indexed", "shakespeare"),
    "logger.name": ("none", "wandb", "tensorboard"),
    "logger.mode": ("online", "offline", "disabled"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.attention_backend": ("auto", "sdpa", "unfused"),
    "model.position_embedding_type": ("learned_absolute", "rope"),
    "model.recompute_granularity": (None, "full", "selective"),
    "model.recompute_method": (None, "uniform", "block"),
    "debug.fail_where": ("forward", "data", "save", "save_write"),
    "debug.fail_kind": ("raise", "sigkill"),
}


@dataclasses.dataclass(frozen=True)
class DerivedLayout:
    """What the config and the world size imply (computed once, identical on every rank).

    Attributes:
        world_size: processes in the job.
        tensor_model_parallel_size, pipeline_model_parallel_size: as configured.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank; None when 1 / unset.
        data_parallel_size: world_size / (tp × pp).
        num_microbatches: global_batch_size / (micro_batch_size × dp), micro-batches per DP rank
            per iteration.
        schedule: the schedule that runs: no_pipelining | gpipe | 1f1b | interleaved_1f1b
            (`auto` and the pp = 1 degenerations resolved).
        sequence_parallel: True only when asked for and tp > 1.
        loss_scaler: the scaler that runs: none | dynamic | constant (`auto` resolved).
    """

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    data_parallel_size: int
    num_microbatches: int
    schedule: str
    sequence_parallel: bool
    loss_scaler: str


def as_config(cfg: Any) -> Config:
    """A `Config` object from a Hydra `DictConfig` (typed or plain, e.g. a saved config.yaml) or a `Config`.

    Merging onto the structured schema makes unknown keys and wrong types fail here too. A key
    that Hydra's ``+key=value`` forced into a typed group survives that merge, so unknown keys are
    also looked for in the result (`_reject_unknown_keys`).

    Raises:
        omegaconf.errors.ValidationError / ConfigKeyError: unknown key or wrong type.
        ConfigError: a key added with ``+`` that the schema does not have (e.g. a misspelt key).
    """
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"as_config: expected a DictConfig, dict or Config, got {type(cfg).__name__}")
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    obj = OmegaConf.to_object(merged)
    _reject_unknown_keys(obj, "")
    return obj


def _reject_unknown_keys(obj: Any, prefix: str) -> None:
    """Raise ConfigError for an attribute of a schema dataclass that is not one of its fields.

    A component node (a schema with a ``_target_`` field, `mptrain.components`) keeps such keys:
    they are its target's own keywords (``+optim.alpha=0.95`` for torch.optim.RMSprop), checked
    against the target's signature at start-up instead (`mptrain.components.resolve`)."""
    fields = {f.name for f in dataclasses.fields(obj)}
    for key in vars(obj):
        if key not in fields and "_target_" not in fields:
            where = prefix.rstrip(".") or "the top level"
            raise ConfigError(f"{prefix}{key}: unknown config key (misspelt? `+` adds keys the schema does not have); "
                              f"valid keys of {where}: {', '.join(sorted(fields))}")
    for name in fields:
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _reject_unknown_keys(value, f"{prefix}{name}.")


def _select(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _fmt(choices: tuple) -> str:
    return ", ".join("null" if c is None else str(c) for c in choices)


def check_choices(cfg: Config) -> None:
    """Reject option names the code does not know (`schedule.name=foo`, `model.activation=relu`).

    Raises:
        ConfigError: naming the key, the value and the valid names.
    """
    for key, choices in CHOICES.items():
        value = _select(cfg, key)
        if value not in choices:
            group = key.split(".")[0]
            fix = f"pick {group}=<option>" if key.endswith(".name") else f"set {key} to one of them"
            raise ConfigError(f"{key}: unknown option {value!r}; valid: {_fmt(choices)}; {fix}")


def _positive(key: str, value: Optional[int], *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be an integer >= 1{' or null' if allow_none else ''}")


def check_parallel_sizes(cfg: Config, world_size: int) -> tuple[int, int, Optional[int], int]:
    """World size vs tp × pp, and the virtual pipeline size; returns (tp, pp, vpp or None, dp).

    Raises:
        ConfigError: sizes below 1; world size not divisible by tp × pp (the DESIGN.md §5 line);
            vpp > 1 with pp = 1.
    """
    par = cfg.parallel
    tp, pp, vpp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    _positive("parallel.tensor_model_parallel_size", tp)
    _positive("parallel.pipeline_model_parallel_size", pp)
    _positive("parallel.virtual_pipeline_model_parallel_size", vpp, allow_none=True)
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be >= 1")
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"parallel: world size {world_size} is not divisible by tensor_model_parallel_size × "
            f"pipeline_model_parallel_size = {tp} × {pp} = {tp * pp}; run with --nproc_per_node={tp * pp} or "
            f"{2 * tp * pp}, or pick another parallel="
        )
    if vpp is not None and vpp > 1 and pp == 1:
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
            f"(got 1); set parallel.virtual_pipeline_model_parallel_size=null or pick parallel=tp1pp2vpp2"
        )
    return tp, pp, (vpp if vpp is not None and vpp > 1 else None), world_size // (tp * pp)


def check_model_shape(cfg: Config, tp: int) -> None:
    """Heads vs tp and hidden; query groups; recompute keys; position embeddings vs seq_length.

    Raises:
        ConfigError: num_attention_heads not divisible by tp, hidden_size not divisible by
            num_attention_heads (without kv_channels), num_query_groups not dividing heads or not
            divisible by tp, inconsistent recompute keys, seq_length > max_position_embeddings.
    """
    m = cfg.model
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _positive(f"model.{key}", getattr(m, key))
    heads = m.num_attention_heads
    if heads % tp != 0:
        raise ConfigError(
            f"model.num_attention_heads={heads} is not divisible by parallel.tensor_model_parallel_size={tp}; "
            f"pick a parallel= with tp dividing {heads}, or another model="
        )
    if m.kv_channels is None and m.hidden_size % heads != 0:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={heads}; "
            f"change one of them or set model.kv_channels"
        )
    groups = m.num_query_groups
    if groups is not None:
        _positive("model.num_query_groups", groups)
        if heads % groups != 0:
            raise ConfigError(
                f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}; "
                f"set model.num_query_groups to a divisor of {heads} (or null for multi-head attention)"
            )
        if groups % tp != 0:
            raise ConfigError(
                f"model.num_query_groups={groups} is not divisible by parallel.tensor_model_parallel_size={tp}; "
                f"use a smaller tp or more query groups"
            )
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings is not None:
        if m.seq_length > m.max_position_embeddings:
            raise ConfigError(
                f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
                f"raise max_position_embeddings or set it to null"
            )
    if m.recompute_granularity == "full" and m.recompute_method is None:
        raise ConfigError(
            "model.recompute_granularity=full needs model.recompute_method=uniform or block (and recompute_num_layers)"
        )
    if m.recompute_granularity != "full" and m.recompute_method is not None:
        raise ConfigError(
            f"model.recompute_method={m.recompute_method} needs model.recompute_granularity=full "
            f"(got {m.recompute_granularity}); set model.recompute_method=null"
        )
    if m.recompute_granularity == "full":
        _positive("model.recompute_num_layers", m.recompute_num_layers)


def check_layer_split(cfg: Config, pp: int, vpp: Optional[int]) -> None:
    """num_layers over pp × vpp stages: even unless decoder_first/last_pipeline_num_layers are set.

    Uneven split (Megatron-core's num_layers_in_first/last_pipeline_stage): the first and/or last
    stage hold the given counts; the other pp − k stages share the rest evenly. With vpp, every
    stage's count must split into vpp chunks.

    Raises:
        ConfigError: num_layers not divisible by pp × vpp (even split), or an uneven split that
            does not add up (naming the keys and the numbers).
    """
    layers = cfg.model.num_layers
    first = cfg.parallel.decoder_first_pipeline_num_layers
    last = cfg.parallel.decoder_last_pipeline_num_layers
    chunks = vpp or 1
    if first is None and last is None:
        if layers % (pp * chunks) != 0:
            vpp_txt = f" × virtual_pipeline_model_parallel_size = {pp} × {chunks} = {pp * chunks}" if vpp else f" = {pp}"
            raise ConfigError(
                f"model.num_layers={layers} is not divisible by pipeline_model_parallel_size{vpp_txt}; "
                f"pick another parallel= or model=, or set parallel.decoder_first_pipeline_num_layers / "
                f"decoder_last_pipeline_num_layers for an uneven split"
            )
        return
    if pp == 1:
        raise ConfigError(
            "parallel.decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers need "
            "pipeline_model_parallel_size > 1 (got 1); set them to null"
        )
    fixed = {k: v for k, v in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)) if v is not None}
    for key, value in fixed.items():
        _positive(f"parallel.{key}", value)
        if value % chunks != 0:
            raise ConfigError(
                f"parallel.{key}={value} is not divisible by virtual_pipeline_model_parallel_size={chunks}; "
                f"give that stage a multiple of {chunks} layers"
            )
    rest = layers - sum(fixed.values())
    middle = pp - len(fixed)
    given = " + ".join(f"{k}={v}" for k, v in fixed.items())
    if middle == 0:
        if rest != 0:
            raise ConfigError(
                f"parallel: {given} must add up to model.num_layers={layers} with pipeline_model_parallel_size={pp}; "
                f"change them"
            )
        return
    if rest < middle * chunks or rest % (middle * chunks) != 0:
        raise ConfigError(
            f"parallel: with {given}, the other {middle} pipeline stage(s) get {rest} of model.num_layers={layers} "
            f"layers, not a positive multiple of {middle}{f' × vpp {chunks}' if vpp else ''}; change the uneven split"
        )


def resolve_schedule(name: str, pp: int, vpp: Optional[int]) -> str:
    """The schedule that runs for `schedule.name` (auto → no_pipelining / 1f1b / interleaved_1f1b).

    Raises:
        ConfigError: interleaved without vpp; vpp with a non-interleaved schedule; no_pipelining
            with pp > 1.
    """
    if name == "auto":
        return "no_pipelining" if pp == 1 else ("interleaved_1f1b" if vpp else "1f1b")
    if name == "interleaved_1f1b" and not vpp:
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size is {'null' if vpp is None else vpp} but schedule=interleaved_1f1b "
            f"needs it > 1 (with pipeline_model_parallel_size={pp}); pick parallel=tp1pp2vpp2 (or another vpp layout) "
            f"or schedule=1f1b"
        )
    if vpp and name != "interleaved_1f1b":
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs schedule=interleaved_1f1b or auto "
            f"(got schedule={name}); pick schedule=auto or a parallel= without vpp"
        )
    if name == "no_pipelining" and pp > 1:
        raise ConfigError(
            f"schedule=no_pipelining cannot run pipeline_model_parallel_size={pp}; pick schedule=auto, 1f1b or gpipe"
        )
    if pp == 1:
        return "no_pipelining"  # gpipe / 1f1b with one stage: no warmup, no p2p (Megatron does the same)
    return name


def check_batch(cfg: Config, dp: int) -> int:
    """global_batch_size vs micro_batch_size × dp; returns num_microbatches.

    Raises:
        ConfigError: sizes below 1 or global_batch_size not divisible by micro_batch_size × dp.
    """
    t = cfg.train
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.global_batch_size", t.global_batch_size)
    step = t.micro_batch_size * dp
    if t.global_batch_size % step != 0:
        lower = max(step, t.global_batch_size // step * step)
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size × data-parallel "
            f"size = {t.micro_batch_size} × {dp} = {step}; set train.global_batch_size={lower} or {lower + step}, "
            f"or change train.micro_batch_size"
        )
    return t.global_batch_size // step


def resolve_loss_scaler(cfg: Config) -> str:
    """The scaler that runs (auto → dynamic for fp16, none otherwise); the rule lives in `mptrain.precision.scaler`.

    Raises:
        ConfigError: fp16 with loss_scaler=none; dynamic with bf16/fp32; unknown names.
    """
    from mptrain.precision.scaler import resolve_loss_scaler_name

    return resolve_loss_scaler_name(cfg.loss_scaler.name, cfg.precision.name)


def check_training_keys(cfg: Config) -> None:
    """Iteration counts, intervals and checkpoint keys.

    Raises:
        ConfigError: non-positive counts/intervals/timeouts; keep_last_n < 0; clip_grad < 0 or not finite;
            load_iteration < 0 or without checkpoint.load; exit_interval or save_interval without
            checkpoint.save.
    """
    t, ck = cfg.train, cfg.checkpoint
    if t.train_iters < 0:
        raise ConfigError(f"train.train_iters={t.train_iters} must be >= 0")
    _positive("train.log_interval", t.log_interval)
    _positive("train.eval_interval", t.eval_interval, allow_none=True)
    if t.eval_interval is not None:
        _positive("train.eval_iters", t.eval_iters)
    _positive("train.exit_interval", t.exit_interval, allow_none=True)
    _positive("checkpoint.save_interval", ck.save_interval, allow_none=True)
    for key, seconds in (("train.timeout_s", t.timeout_s), ("train.step_timeout_s", t.step_timeout_s)):
        # the upper bound: gloo's timeout in int64 nanoseconds, the heartbeat's wait (threading.TIMEOUT_MAX)
        if seconds is not None and not 0 < seconds <= MAX_TIMEOUT_S:
            raise ConfigError(f"{key}={seconds} must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}"
                              + (" or null (no step timeout)" if "step" in key else ""))
    if not (t.clip_grad >= 0 and t.clip_grad != float("inf")):  # also rejects NaN
        raise ConfigError(f"train.clip_grad={t.clip_grad} must be a finite number >= 0 (0 = no clipping)")
    if ck.keep_last_n is not None and ck.keep_last_n < 0:
        raise ConfigError(f"checkpoint.keep_last_n={ck.keep_last_n} must be >= 1, or 0 / null (keep every checkpoint)")
    if ck.load_iteration is not None and ck.load_iteration < 0:
        raise ConfigError(f"checkpoint.load_iteration={ck.load_iteration} must be >= 0, or null (the folder's latest)")
    if ck.load_iteration is not None and not ck.load:
        raise ConfigError(f"checkpoint.load_iteration={ck.load_iteration} needs checkpoint.load=<folder>; set it, or "
                          "checkpoint.load_iteration=null")
    if t.timing_log_level not in (0, 1, 2):
        raise ConfigError(f"train.timing_log_level={t.timing_log_level} must be 0, 1 or 2")
    for key, value in (("train.exit_interval", t.exit_interval), ("checkpoint.save_interval", ck.save_interval)):
        if value is not None and ck.save is None:
            raise ConfigError(f"{key}={value} needs checkpoint.save=<folder> to save into; set it, or {key}=null")


def validate_config(cfg: Any, world_size: int) -> DerivedLayout:
    """Check every DESIGN.md §5 combination and derive the layout; pure (no collectives, no I/O).

    Args:
        cfg: the composed config (`DictConfig` from Hydra, or a `Config`).
        world_size: number of processes (torchrun's WORLD_SIZE).
    Returns:
        the `DerivedLayout` (dp size, num_microbatches, resolved schedule and loss scaler).
    Raises:
        ConfigError: the first problem found, one line naming the key(s), the values and the fix.
            Order: option names, layout sizes, model shape, layer split, batch, schedule, scaler,
            training keys.
    """
    c = as_config(cfg)
    check_choices(c)
    tp, pp, vpp, dp = check_parallel_sizes(c, world_size)
    check_model_shape(c, tp)
    check_layer_split(c, pp, vpp)
    num_microbatches = check_batch(c, dp)
    schedule = resolve_schedule(c.schedule.name, pp, vpp)
    if schedule == "interleaved_1f1b" and num_microbatches % pp != 0:
        raise ConfigError(
            f"schedule=interleaved_1f1b needs num_microbatches % pipeline_model_parallel_size == 0, got "
            f"{num_microbatches} micro-batches (train.global_batch_size={c.train.global_batch_size} / "
            f"(micro_batch_size {c.train.micro_batch_size} × dp {dp})) and pp={pp}; make global_batch_size a multiple "
            f"of {c.train.micro_batch_size * dp * pp}"
        )
    sequence_parallel = bool(c.parallel.sequence_parallel and tp > 1)
    if sequence_parallel and c.model.seq_length % tp != 0:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits the sequence over tp: model.seq_length={c.model.seq_length} is "
            f"not divisible by tensor_model_parallel_size={tp}; change seq_length or set parallel.sequence_parallel=false"
        )
    if c.parallel.tp_comm_overlap and not (sequence_parallel and c.model.compile_layers):
        missing = [need for need, ok in (("tensor_model_parallel_size > 1", tp > 1),
                                         ("parallel.sequence_parallel=true", c.parallel.sequence_parallel),
                                         ("model.compile_layers=true", c.model.compile_layers)) if not ok]
        raise ConfigError(
            "parallel.tp_comm_overlap=true overlaps the sequence-parallel collectives inside compiled layers on CUDA GPUs "
            f"with NCCL; it also needs {' and '.join(missing)} (got tp={tp}); set those or parallel.tp_comm_overlap=false"
        )
    loss_scaler = resolve_loss_scaler(c)
    check_training_keys(c)
    return DerivedLayout(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        data_parallel_size=dp,
        num_microbatches=num_microbatches,
        schedule=schedule,
        sequence_parallel=sequence_parallel,
        loss_scaler=loss_scaler,
    )


def check_vocab_size(model_vocab_size: Optional[int], tokenizer_vocab_size: int) -> int:
    """The model's unpadded vocabulary: `model.vocab_size`, or the tokenizer's when null.

    Raises:
        ConfigError: the tokenizer has more ids than the model's vocabulary (DESIGN.md §5 `vocab_size`).
    """
    if model_vocab_size is None:
        return tokenizer_vocab_size
    if tokenizer_vocab_size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size} ids; "
            f"set model.vocab_size=null (take the tokenizer's) or >= {tokenizer_vocab_size}"
        )
    return model_vocab_size
