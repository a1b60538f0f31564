"""`python -m mptrain.check [training overrides] world_size=N`: validate a layout without GPUs.

1. composes `conf/plan.yaml` (the training config groups + `world_size`) and runs the trainer's
   `validate_config` (its checks no layout changes first, `check_layout_free`); a ConfigError prints one
   line and exits 1, as `train.py`;
2. spawns N CPU processes (gloo, world N) that build the process groups of the layout and the
   trainer's own objects with `training.run.build_model_and_optimizer` on the META device: model
   chunks (layer split, TP shapes, padded vocab, tied copy), Float16Module, DDP grad buffers and
   the optimizer wrapper's fp32 main params, and under precision=fp8 the cached FP8 weight casts (counted
   in the weights; none under ZeRO-2 / ZeRO-3) — shapes and dtypes only, no memory, so gpt_13b checks
   on a laptop. (The tied-embedding sync runs on meta tensors; nothing is computed.)
3. prints, per rank: coordinates, layers held, parameter elements, and the bytes of weights /
   grads / main params MEASURED from those objects next to the planner's formula
   (`mptrain.planner`); PLANNED only: optimizer state (Adam's state is created lazily at the first
   step, which a meta dry run does not take), activations and logits (nothing runs on meta), and the
   planned total with its fit verdict (`hardware.gpu_memory_gib` less `hardware.memory_headroom_gib`);
4. with CUDA, measures the activations too: one micro-batch's forward + backward through the model cut
   to k and 2k transformer layers on one GPU (tp 1), ``torch.cuda.max_memory_allocated`` above the weights;
   the difference per layer is printed next to the planner's for the same cut (embedding and logits cancel).
   Without CUDA the report says the activations are planned only.
Exit status 1 when a rank's measured weights / grads / main params differ from the planner's by more than
2 % (the activation line informs; the allocator's rounding and transients make it no exact match).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from typing import Optional

import hydra
from omegaconf import OmegaConf

from mptrain.config.model import recompute_granularity
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
    from mptrain.planner.measure import layers_of, measured_rank_bytes, meta_groups
    from mptrain.planner.layouts import config_layout, layout_config
    from mptrain.planner.memory import model_state_bytes, stage_memory
    from mptrain.planner.params import rank_params
    from mptrain.training.run import build_model_and_optimizer, convert_to_fp8

    groups = build_groups(derived.tensor_model_parallel_size, derived.pipeline_model_parallel_size,
                          derived.virtual_pipeline_model_parallel_size,
                          expert_model_parallel_size=derived.expert_model_parallel_size,
                          expert_tensor_parallel_size=derived.expert_tensor_parallel_size,
                          context_parallel_size=derived.context_parallel_size,
                          data_parallel_shard_size=cfg.parallel.data_parallel_shard_size)
    try:
        chunks, optimizer, *_ = build_model_and_optimizer(cfg, meta_groups(groups), derived, vocab_size=vocab_size)
        # as `training.run.build`: precision=fp8 adds the block linears' cached FP8 weight casts (none under ZeRO-2/3)
        convert_to_fp8(cfg, chunks)
        measured = measured_rank_bytes(chunks, optimizer)
        layout = config_layout(cfg, derived)
        c = layout_config(cfg, layout)
        rp = rank_params(cfg.model, c.parallel, vocab_size=vocab_size, pp_rank=groups.pp_rank, tp_rank=groups.tp_rank)
        planned = model_state_bytes(cfg, layout, rp)
        stage = stage_memory(c, layout, rp, pp_rank=groups.pp_rank, vocab_size=vocab_size)
        return {**groups.coordinates(), "layers": layers_of(chunks), "measured": measured, "planned": planned,
                "planned_gib": stage.gib(), "planned_numel": rp.numel, "planned_num_params": rp.num_params}
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


def run_check(cfg, world_size: int, *, timeout_s: float = 600.0, mp_context=None) -> list:
    """Validate, then dry-run the layout on ``world_size`` spawned gloo processes; facts by rank.

    ``mp_context``: the `multiprocessing` context that starts the ranks (None: "spawn", a fresh interpreter
    each; a caller that holds a forkserver with torch imported passes it to skip the imports).

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
    ctx = mp_context or mp.get_context("spawn")
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


def _cuda_worker(port, cfg, vocab_size, layer_counts, results) -> None:
    """World of one on GPU 0 (NCCL): `cuda_activation_peak_bytes` for each count of ``layer_counts``."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"})
    import torch
    import torch.distributed as dist

    from mptrain.groups import build_groups
    from mptrain.planner.measure import cuda_activation_peak_bytes

    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        groups = build_groups(1, 1, device=device)
        try:
            out = {n: cuda_activation_peak_bytes(cfg, groups, vocab_size=vocab_size, num_layers=n) for n in layer_counts}
        finally:
            groups.destroy()
        dist.destroy_process_group()
        results.put((0, True, out))
    except BaseException:  # noqa: BLE001 - the parent prints the traceback
        results.put((0, False, traceback.format_exc()))


def one_gpu_layout(cfg):
    """The layout activations are measured in: one GPU (tp = pp = dp = 1), one micro-batch in flight, the
    config's recomputation."""
    from mptrain.planner.memory import PlanLayout

    return PlanLayout(1, 1, None, 1, False, recompute_granularity(cfg.model) or "none", False, "no_pipelining", 1)


def one_gpu_config(cfg, *, num_layers: Optional[int] = None):
    """A copy of ``cfg`` in `one_gpu_layout` (one stage: no uneven pipeline split), cut to ``num_layers`` layers
    when given."""
    from mptrain.planner.layouts import layout_config

    c = layout_config(cfg, one_gpu_layout(cfg))
    c.parallel.decoder_first_pipeline_num_layers = c.parallel.decoder_last_pipeline_num_layers = None
    if num_layers is not None:
        c.model.num_layers = num_layers
    return c


def measured_layer_counts(cfg) -> tuple:
    """(k, 2k) transformer layers of the two measured cuts: k = 2, or twice a full-recompute group (whole groups)."""
    group = (cfg.model.recompute_num_layers or 1) if recompute_granularity(cfg.model) == "full" else 1
    return 2 * group, 4 * group


def planned_activation_bytes(cfg, *, num_layers: int, vocab_size: int) -> float:
    """The planner's activations of one micro-batch through the model cut to ``num_layers`` layers on one GPU
    (`one_gpu_layout`): what `cuda_activation_peak_bytes` measures, less the logits (they cancel in the check's
    difference)."""
    from mptrain.planner.memory import stage_activation_bytes
    from mptrain.planner.params import rank_params

    layout = one_gpu_layout(cfg)
    c = one_gpu_config(cfg, num_layers=num_layers)
    rp = rank_params(c.model, c.parallel, vocab_size=vocab_size, pp_rank=0, tp_rank=0)
    return stage_activation_bytes(c, layout, rp, pp_rank=0)


def measure_activations(cfg, *, vocab_size: int, timeout_s: float = 600.0) -> dict:
    """On a CUDA machine: one micro-batch's activations per transformer layer, measured and planned.

    Runs `cuda_activation_peak_bytes` in one spawned process on GPU 0 for the model cut to k and 2k layers
    (`measured_layer_counts`); the per-layer figure is the difference over k (the embedding, the logits and the
    CUDA allocator's own blocks cancel).

    Returns:
        {"layers": k, "measured": bytes per layer (peak of forward + backward), "saved": bytes per layer kept
        after the forward, "planned": the planner's bytes per layer for the same cut}.
    Raises:
        RuntimeError: the measuring process failed (its traceback) or timed out.
    """
    from mptrain.config.schema import as_config

    cfg = as_config(cfg)
    k, k2 = measured_layer_counts(cfg)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_cuda_worker, args=(_free_port(), one_gpu_config(cfg), vocab_size, (k, k2), results),
                       daemon=True)
    proc.start()
    try:
        _, ok, value = results.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"check: measuring the activations on CUDA took more than {timeout_s:g} s") from None
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise RuntimeError(f"check: measuring the activations on CUDA failed:\n{value}")
    planned = [planned_activation_bytes(cfg, num_layers=n, vocab_size=vocab_size) for n in (k, k2)]
    return {"layers": k, "measured": (value[k2]["peak"] - value[k]["peak"]) / k,
            "saved": (value[k2]["saved"] - value[k]["saved"]) / k, "planned": (planned[1] - planned[0]) / k}


def layer_ranges(layers: list) -> str:
    """A rank's layers as their contiguous runs and count: ``0..7, 16..23 (16)`` (an interleaved stage holds one
    run per chunk), ``3 (1)``, ``-`` for none."""
    if not layers:
        return "-"
    runs = [[layers[0], layers[0]]]
    for n in layers[1:]:
        if n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs) + f" ({len(layers)})"


def _gib(x: float) -> str:
    return f"{x / 2**30:8.3f}"


MEASURED_PARTS = ("measured: weights, grads, main params (the trainer's own objects, built on the meta device); "
                  "planned only: optimizer state (Adam creates it at the first step), activations and logits "
                  "(nothing runs on meta)")


def activation_line(activations: Optional[dict], cfg) -> str:
    """The report's activation line: measured vs planned on CUDA (`measure_activations`), else planned only
    (``activations`` None: no CUDA device; ``{"error": line}``: the measurement failed)."""
    if activations is None:
        return ("activations: planned only (no CUDA device here); on a GPU machine `python -m mptrain.check` "
                "measures one micro-batch's forward + backward")
    if "error" in activations:
        return f"activations: planned only (measuring them on CUDA failed: {activations['error']})"
    saved, planned = activations["saved"], activations["planned"]
    # the planner plans what the forward keeps for the backward (Korthikanti et al. 2022, sec. 4): that is the
    # compared figure; the peak adds the backward's transient buffers
    return (f"activations per transformer layer, one micro-batch (s={cfg.model.seq_length}, "
            f"b={cfg.train.micro_batch_size}, tp 1, {activations['layers']} vs {2 * activations['layers']} layers, "
            f"measured on CUDA): kept for the backward measured {_gib(saved).strip()} / planned "
            f"{_gib(planned).strip()} GiB ({100 * (saved - planned) / max(planned, 1):+.1f} %); peak of forward + "
            f"backward above the weights {_gib(activations['measured']).strip()} GiB")


def format_report(cfg, facts: list, activations: Optional[dict] = None) -> tuple:
    """(text, worst relative deviation of measured vs planned model-state bytes).

    The text says which parts are measured (`MEASURED_PARTS`), prints per rank the measured / planned model
    states, the planned activations + logits and total, the busiest rank's fit verdict against ``cfg.hardware``
    (`mptrain.planner.layouts.fit_verdict`), the activation line (``activations``: `measure_activations`'s result
    on CUDA, None: planned only), and an ``assumed:`` line when the optimizer state of ``optim._target_`` is not
    known to the planner."""
    from mptrain.distributed.strategy import sharding_strategy
    from mptrain.planner.layouts import fit_verdict
    from mptrain.planner.memory import optimizer_states_per_element

    p = cfg.parallel
    hsdp = f" data_parallel_shard_size={p.data_parallel_shard_size}" if p.data_parallel_shard_size else ""
    offload = " optimizer_cpu_offload=true" if cfg.optim.optimizer_cpu_offload else ""
    lines = [f"check: model={cfg.model.name} world_size={len(facts)} parallel={p.name} "
             f"precision={cfg.precision.name} distributed_optimizer={p.use_distributed_optimizer} "
             f"data_parallel_sharding_strategy={sharding_strategy(p)}{hsdp}{offload}",
             MEASURED_PARTS,
             "rank tp pp dp  layers            params(local)  | GiB measured / planned: weights, grads, main | "
             "planned: optim state, acts+logits, total"]
    worst = 0.0
    for f in facts:
        m, p, g = f["measured"], f["planned"], f["planned_gib"]
        for key in ("weights", "grads", "main_params"):
            if p[key] or m[key]:
                worst = max(worst, abs(m[key] - p[key]) / max(p[key], 1))
        lines.append(f"{f['rank']:>4} {f['tp']:>2} {f['pp']:>2} {f['dp']:>2}  {layer_ranges(f['layers']):<17} "
                     f"{m['num_params']:>14,}  | {_gib(m['weights'])}/{_gib(p['weights'])} "
                     f"{_gib(m['grads'])}/{_gib(p['grads'])} {_gib(m['main_params'])}/{_gib(p['main_params'])} | "
                     f"{_gib(p['optimizer_state'])} {g['activations'] + g['logits']:8.3f} {g['total']:8.3f}")
    lines.append(f"worst measured-vs-planned deviation (weights, grads, main params): {100 * worst:.3f} % "
                 f"(tolerance {100 * TOLERANCE:g} %)")
    busiest = max(facts, key=lambda f: f["planned_gib"]["total"])
    hw = cfg.hardware
    verdict = {"yes": "fits", "tight": "tight (within the headroom: may run out of memory)",
               "no": "does not fit"}[fit_verdict(busiest["planned_gib"]["total"], hw)]
    lines.append(f"planned peak: {busiest['planned_gib']['total']:.3f} GiB (rank {busiest['rank']}) of "
                 f"hardware.gpu_memory_gib={hw.gpu_memory_gib:g}, leaving hardware.memory_headroom_gib="
                 f"{hw.memory_headroom_gib:g} free: {verdict}")
    lines.append(activation_line(activations, cfg))
    note = optimizer_states_per_element(cfg)[1]
    if note is not None:
        lines.append(f"assumed: {note}")
    return "\n".join(lines), worst


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="plan")
def main(cfg) -> None:
    import torch

    from mptrain.data.tokenizers import build_tokenizer, check_vocab_size

    c = OmegaConf.to_object(cfg)
    try:
        check_plan_keys(c)
        facts = run_check(c, c.world_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    activations = None
    if torch.cuda.is_available():  # the one part a meta build cannot show, measured where it can be
        vocab_size = check_vocab_size(c.model.vocab_size, build_tokenizer(c.data).vocab_size)
        try:
            activations = measure_activations(c, vocab_size=vocab_size)
        except RuntimeError as err:  # e.g. out of memory at a long sequence: the report stands, its line says so
            activations = {"error": str(err).strip().splitlines()[-1]}
    text, worst = format_report(c, facts, activations)
    print(text)
    if worst > TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    from mptrain.config.cli import exit_on_compose_error

    # one line for an override Hydra cannot compose
    exit_on_compose_error(str(CONF_DIR), config_name="plan", program="python -m mptrain.check")
    main()
