"""`python -m mptrain.plan [training overrides] world_size=N [hardware.gpu_memory_gib=80] [format=table|json]`

Plan before you launch: for every layout `train.py` would accept at `world_size`
(tp, cp, pp, vpp, dp, distributed optimizer, and ZeRO-2 / ZeRO-3 when parallel.data_parallel_sharding_strategy
names one, recomputation none/selective/full, sequence parallelism; cp > 1
for sequences long enough, `mptrain.planner.layouts.cp_options`; for an MoE model expert parallelism ep, which
divides model.num_moe_experts),
the per-GPU memory of the busiest pipeline stage (weights, grads, fp32 main params, optimizer
state, activations of the schedule's in-flight micro-batches, logits), whether it fits
`hardware.gpu_memory_gib` leaving `hardware.memory_headroom_gib` free (tight: only within that headroom), the bytes each rank sends per step by group, the pipeline bubble and an
assumed-hardware step time; fitting layouts first, then the fastest. Formulas and measured
constants: `mptrain.planner.memory` / docs/PLANNER.md.

`format=json` prints a JSON list (every layout, ranked) with the keys `tp`, `cp`, `pp`, `vpp`, `dp`, `ep`, `edp`
(expert-data-parallel size), `use_distributed_optimizer`, `data_parallel_sharding_strategy` (the one that runs),
`data_parallel_shard_size` (ZeRO-2 / ZeRO-3's shard group, else null), `optimizer_cpu_offload`, `recompute`,
`memory_gib` (weights, grads, main_params, optimizer_state, activations, logits, optimizer_workspace, gathered:
FSDP's unsharded params at the peak, offloaded: the model states in host memory, total: device memory), `fits`, `tight`, `bubble_fraction`,
`comm_bytes` (tp, pp, dp, embedding, ep: the MoE token dispatch, edp: the expert grads, cp: the ring's), and also
`sequence_parallel`, `schedule`, `num_microbatches`, `peak_stage`, `stage_total_gib`, `step_time_s`,
`parameters` (total, active: per token, what FLOPs and MFU count), `cp_ring_vs_attention_s` (a layer's ring and
attention seconds per micro-batch), `assumptions` (lines saying what a user optimizer's state or a user
schedule's in-flight micro-batches were assumed to be, or how an MoE model's tokens were assumed to route; the
table prints them as `assumed: ...` lines).
A ConfigError prints one line and exits 1.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import hydra
from omegaconf import OmegaConf

from mptrain.errors import ConfigError
from mptrain.layers.fp8 import fp8_recipe_from
from mptrain.planner.config import CONF_DIR, FORMATS, check_plan_keys, register_plan
from mptrain.planner.layouts import plan

register_plan()


def plan_from_config(cfg: Any) -> tuple:
    """(PlanConfig object, ranked records) for a composed `plan` config (DictConfig or PlanConfig).

    Raises:
        ConfigError: a key added with ``+`` that the schema (or, under ``precision``, its wrapper) does not take,
            a hardware number out of range, world_size < 1 (`check_plan_keys`), unknown format, top < 1, the
            tokenizer's vocab larger than the model's, or no valid layout.
    """
    from mptrain.data.tokenizers import build_tokenizer, check_vocab_size

    c = OmegaConf.to_object(cfg) if OmegaConf.is_config(cfg) else cfg
    check_plan_keys(c)
    if c.format not in FORMATS:
        raise ConfigError(f"format={c.format!r} is not one of {list(FORMATS)}; use format=table or format=json")
    if c.top is not None and c.top < 1:
        raise ConfigError(f"top={c.top} must be >= 1 (rows of the table), or top=null for all of them")
    vocab_size = check_vocab_size(c.model.vocab_size, build_tokenizer(c.data).vocab_size)
    return c, plan(c, c.world_size, c.hardware, vocab_size=vocab_size)


def plan_warnings(c) -> list:
    """The trainer's start-up warnings that the config alone decides (``warning: ...`` lines), said before
    the launch rather than after: precision=fp8 with every layer kept bf16."""
    recipe = fp8_recipe_from(c.precision)
    warning = recipe.all_layers_bf16_warning(c.model.num_layers) if recipe is not None else None
    return [warning] if warning else []


def plan_title(c) -> str:
    """The first line of the table: what was planned (the keys a reader would otherwise have to guess, e.g. the
    precision, fp32 unless given)."""
    m, t = c.model, c.train
    return (f"plan: model={m.name} ({m.num_layers} layers x {m.hidden_size}) precision={c.precision.name} "
            f"seq_length={m.seq_length} micro_batch_size={t.micro_batch_size} global_batch_size={t.global_batch_size} "
            f"world_size={c.world_size}")


def parameters_line(records: list) -> str:
    """``parameters: N total, M active per token ...`` for an MoE model (its experts make the two differ); empty
    for a dense model."""
    if not records or records[0]["parameters"]["total"] == records[0]["parameters"]["active"]:
        return ""
    p = records[0]["parameters"]
    return (f"parameters: {p['total']:,} total, {p['active']:,} active per token "
            "(router, top-k experts, shared expert: what FLOPs and MFU count)")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


ZERO = {"no_shard": "0", "optim": "1", "optim_grads": "2", "optim_grads_params": "3"}


def _zero(record: dict) -> str:
    """The ZeRO stage of a record's data-parallel strategy; ``h``: HSDP (sharded within groups), ``o``: offloaded."""
    stage = ZERO[record["data_parallel_sharding_strategy"]]
    shard = record["data_parallel_shard_size"]
    hsdp = "h" if shard is not None and shard < record["dp"] * record["cp"] else ""
    return stage + hsdp + ("o" if record["optimizer_cpu_offload"] else "")


def _fit(record: dict) -> str:
    return "yes" if record["fits"] else "tight" if record["tight"] else "no"


def format_table(records: list, *, top=None, gpu_memory_gib: float, memory_headroom_gib: float = 0.0) -> str:
    """A fixed-width table of the ranked records (GiB; comm in GB sent per rank per step); ``fits`` is yes, tight
    (within ``memory_headroom_gib`` of the GPU's memory) or no."""
    head = (f"{'#':>3} {'tp':>2} {'cp':>2} {'pp':>2} {'vpp':>3} {'dp':>3} {'ep':>2} {'zero':>5} {'recomp':>9} "
            f"{'sp':>3} {'sched':>16} {'m':>4} | {'weights':>7} {'grads':>6} {'main':>6} {'optim':>6} {'acts':>7} "
            f"{'logits':>6} {'gath':>6} {'total':>7} {'fits':>5} | {'bubble':>6} {'tp GB':>7} {'pp GB':>6} {'dp GB':>6} "
            f"{'ep GB':>6} {'cp GB':>6} {'step s':>7}")
    lines = [f"per-GPU memory of the busiest stage (GiB) vs {gpu_memory_gib:g} GiB, of which a layout leaves "
             f"hardware.memory_headroom_gib={memory_headroom_gib:g} free to fit (tight: it does not); "
             "comm = GB sent per rank per step (dp: grads over DP and expert-DP, ZeRO-2/3: FSDP's gathers too; ep: "
             "the MoE token dispatch); zero: the ZeRO stage (0 DDP; h: HSDP; o: CPU offload); gath: FSDP's gathered params "
             "at the peak; total: device memory (offloaded shards out)",
             head, "-" * len(head)]
    for i, r in enumerate(records[:top] if top else records, 1):
        mem, comm = r["memory_gib"], r["comm_bytes"]
        lines.append(
            f"{i:>3} {r['tp']:>2} {r['cp']:>2} {r['pp']:>2} {r['vpp'] or '-':>3} {r['dp']:>3} {r['ep']:>2} "
            f"{_zero(r):>5} "
            f"{r['recompute']:>9} {_yes(r['sequence_parallel'])[:3]:>3} {r['schedule']:>16} {r['num_microbatches']:>4} | "
            f"{mem['weights']:>7.2f} {mem['grads']:>6.2f} {mem['main_params']:>6.2f} {mem['optimizer_state']:>6.2f} "
            f"{mem['activations']:>7.2f} {mem['logits']:>6.2f} {mem['gathered']:>6.2f} {mem['total']:>7.2f} {_fit(r):>5} | "
            f"{r['bubble_fraction']:>6.3f} {comm['tp'] / 1e9:>7.2f} {comm['pp'] / 1e9:>6.2f} "
            f"{(comm['dp'] + comm['edp']) / 1e9:>6.2f} {comm['ep'] / 1e9:>6.2f} {comm['cp'] / 1e9:>6.2f} "
            f"{r['step_time_s']:>7.3f}")
    shown = min(len(records), top or len(records))
    lines.append(f"{shown} of {len(records)} layouts shown ({sum(r['fits'] for r in records)} fit, "
                 f"{sum(r['tight'] for r in records)} tight); "
                 "weights/grads/main/optim: formulas; acts: Korthikanti et al. 2022 with measured constants; "
                 "step s: assumed hardware")
    notes = dict.fromkeys(n for r in records for n in r.get("assumptions", ()))  # unique, in order
    lines += [f"assumed: {n}" for n in notes]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="plan")
def main(cfg) -> None:
    try:
        c, records = plan_from_config(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    if c.format == "json":
        print(json.dumps(records, indent=1))
    else:
        print(plan_title(c))
        if parameters_line(records):
            print(parameters_line(records))
        print(format_table(records, top=c.top, gpu_memory_gib=c.hardware.gpu_memory_gib,
                           memory_headroom_gib=c.hardware.memory_headroom_gib))
    for warning in plan_warnings(c):
        print(warning, file=sys.stderr, flush=True)


if __name__ == "__main__":
    from mptrain.config.cli import exit_on_compose_error

    # one line for an override Hydra cannot compose
    exit_on_compose_error(str(CONF_DIR), config_name="plan", program="python -m mptrain.plan")
    main()
