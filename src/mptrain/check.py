"""`python -m mptrain.check [training overrides] world_size=N`: validate a layout without GPUs.

1. composes `conf/plan.yaml` (the training config groups + `world_size`) and runs the trainer's
   `validate_config` (its checks no layout changes first, `check_layout_free`); a ConfigError prints one
   line and exits 1, as `train.py`;
2. spawns N CPU processes (gloo, world N) that build the process groups of the layout and the
   trainer's own objects with `training.run.build_model_and_optimizer` on the META device: model
   chunks (layer split, TP shapes, padded vocab, tied copy), Float16Module, DDP grad buffers and
   the optimizer wrapper's fp32 main params, and under precision=fp8 the cached FP8 weight casts (counted
   in the weights) — shapes and dtypes only, no memory, so gpt_13b checks
   on a laptop. (The tied-embedding sync runs on meta tensors; nothing is computed.)
3. prints, per rank: coordinates, layers held, parameter elements, and the bytes of weights /
   grads / main params measured from those objects next to the planner's formula
   (`mptrain.planner`); optimizer state is the planner's formula (Adam's state is created lazily
   at the first step, which a meta dry run does not take).
Exit status 1 when a rank's measured bytes differ from the planner's by more than 2 %.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import traceback

import hydra
from omegaconf import OmegaConf

from mptrain.errors import ConfigError
from mptrain.planner.config import CONF_DIR, check_plan_keys, register_plan

register_plan()

TOLERANCE = 0.02  # the planner's model-state formulas ignore bucket padding (< dp elements per bucket)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dry_run_rank(rank: int, world_size: int, cfg, derived, vocab_size: int) -> dict:
    """On an initialised default group: groups + the trainer's objects on meta; this rank's facts."""
    from mptrain.groups import build_groups
    from mptrain.layers.fp8 import apply_fp8, fp8_recipe_from
    from mptrain.planner.measure import layers_of, measured_rank_bytes, meta_groups
    from mptrain.planner.layouts import layout_config
    from mptrain.planner.memory import PlanLayout, model_state_bytes
    from mptrain.planner.params import rank_params
    from mptrain.precision.module import unwrap
    from mptrain.training.run import build_model_and_optimizer

    groups = build_groups(derived.tensor_model_parallel_size, derived.pipeline_model_parallel_size,
                          derived.virtual_pipeline_model_parallel_size)
    try:
        chunks, optimizer, *_ = build_model_and_optimizer(cfg, meta_groups(groups), derived, vocab_size=vocab_size)
        # as `training.run.build`: precision=fp8 adds the block linears' cached FP8 weight casts
        apply_fp8([unwrap(c) for c in chunks], fp8_recipe_from(cfg.precision), num_layers=cfg.model.num_layers)
        measured = measured_rank_bytes(chunks, optimizer)
        p = cfg.parallel
        layout = PlanLayout(groups.tp_size, groups.pp_size, groups.vpp_size, groups.dp_size,
                            p.use_distributed_optimizer, cfg.model.recompute_granularity or "none",
                            derived.sequence_parallel, derived.schedule, derived.num_microbatches)
        rp = rank_params(cfg.model, layout_config(cfg, layout).parallel, vocab_size=vocab_size,
                         pp_rank=groups.pp_rank, tp_rank=groups.tp_rank)
        planned = model_state_bytes(cfg, layout, rp)
        return {**groups.coordinates(), "layers": layers_of(chunks), "measured": measured, "planned": planned,
                "planned_numel": rp.numel, "planned_num_params": rp.num_params}
    finally:
        groups.destroy()


def _worker(rank, world_size, port, cfg, derived, vocab_size, results) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"})
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, True, dry_run_rank(rank, world_size, cfg, derived, vocab_size)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent prints the failing rank's traceback
        results.put((rank, False, traceback.format_exc()))


def run_check(cfg, world_size: int, *, timeout_s: float = 600.0) -> list:
    """Validate, then dry-run the layout on ``world_size`` spawned gloo processes; facts by rank.

    Raises:
        ConfigError: the config is invalid (before any process is spawned).
        RuntimeError: a rank failed (its traceback) or timed out.
    """
    from mptrain.config.schema import as_config
    from mptrain.data.tokenizers import build_tokenizer, check_vocab_size
    from mptrain.layers.fp8 import check_fp8_installed
    from mptrain.training.validate import validate_config

    cfg = as_config(cfg)
    derived = validate_config(cfg, world_size, world_size_flag="world_size")
    check_fp8_installed(cfg.precision)  # the dry run applies FP8 as the trainer does (torchao's modules)
    vocab_size = check_vocab_size(cfg.model.vocab_size, build_tokenizer(cfg.data).vocab_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, cfg, derived, vocab_size, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"check: rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def _gib(x: float) -> str:
    return f"{x / 2**30:8.3f}"


def format_report(cfg, facts: list) -> tuple:
    """(text, worst relative deviation of measured vs planned model-state bytes); an ``assumed:`` line when
    the optimizer state of ``optim._target_`` is not known to the planner."""
    from mptrain.planner.memory import optimizer_states_per_element

    lines = [f"check: model={cfg.model.name} world_size={len(facts)} parallel={cfg.parallel.name} "
             f"precision={cfg.precision.name} distributed_optimizer={cfg.parallel.use_distributed_optimizer}",
             "rank tp pp dp  layers            params(local)  | GiB measured (meta objects) / planned: "
             "weights, grads, main | optim state (planned)"]
    worst = 0.0
    for f in facts:
        m, p = f["measured"], f["planned"]
        for key in ("weights", "grads", "main_params"):
            if p[key] or m[key]:
                worst = max(worst, abs(m[key] - p[key]) / max(p[key], 1))
        layers = f["layers"]
        span = f"{layers[0]}..{layers[-1]} ({len(layers)})" if layers else "-"
        lines.append(f"{f['rank']:>4} {f['tp']:>2} {f['pp']:>2} {f['dp']:>2}  {span:<17} {m['num_params']:>14,}  | "
                     f"{_gib(m['weights'])}/{_gib(p['weights'])} {_gib(m['grads'])}/{_gib(p['grads'])} "
                     f"{_gib(m['main_params'])}/{_gib(p['main_params'])} | {_gib(p['optimizer_state'])}")
    lines.append(f"worst measured-vs-planned deviation: {100 * worst:.3f} % (tolerance {100 * TOLERANCE:g} %)")
    note = optimizer_states_per_element(cfg)[1]
    if note is not None:
        lines.append(f"assumed: {note}")
    return "\n".join(lines), worst


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="plan")
def main(cfg) -> None:
    c = OmegaConf.to_object(cfg)
    try:
        check_plan_keys(c)
        facts = run_check(c, c.world_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    text, worst = format_report(c, facts)
    print(text)
    if worst > TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    from mptrain.config.cli import exit_on_compose_error

    # one line for an override Hydra cannot compose
    exit_on_compose_error(str(CONF_DIR), config_name="plan", program="python -m mptrain.check")
    main()
