"""Predicted (planner) vs measured (torch.cuda.max_memory_allocated) peak memory, per rank.

    torchrun --nproc_per_node=8 bench/plan_check.py model=gpt_1.3b precision=bf16 parallel=tp2pp2 \
        train.micro_batch_size=1 train.global_batch_size=16 train.train_iters=4 train.eval_interval=null \
        run.dir=outputs/plan_check/tp2pp2 [--json OUT.json]

Composes the training config (conf/config.yaml, the same overrides as train.py), trains with
`mptrain.training.run.run`, then every rank reads its own `torch.cuda.max_memory_allocated()` and
the planner's prediction for its pipeline stage (`mptrain.planner.memory.stage_memory`); the
default process group (still up after `run`) gathers them to rank 0, which prints one row per rank
(parts of the prediction, predicted total, measured peak, relative error) and writes
`<run.dir>/plan_check.json`. On CPU the measured column is null (no allocator statistics).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def _compose(overrides: list):
    from hydra import compose, initialize_config_dir

    from mptrain.config.schema import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _prediction(cfg, rank_coords: dict, vocab_size: int) -> dict:
    from mptrain.training.validate import validate_config
    from mptrain.planner.layouts import config_layout, layout_config
    from mptrain.planner.memory import stage_memory
    from mptrain.planner.params import rank_params

    d = validate_config(cfg, dist.get_world_size())
    layout = config_layout(cfg, d)
    rp = rank_params(cfg.model, layout_config(cfg, layout).parallel, vocab_size=vocab_size,
                     pp_rank=rank_coords["pp"], tp_rank=rank_coords["tp"])
    parts = stage_memory(cfg, layout, rp, pp_rank=rank_coords["pp"], vocab_size=vocab_size)
    return parts.gib()


def main(argv: list) -> None:
    from mptrain.config.schema import as_config
    from mptrain.data.tokenizers import build_tokenizer, check_vocab_size
    from mptrain.groups import rank_coordinates
    from mptrain.training.run import run

    json_out = None
    if "--json" in argv:
        i = argv.index("--json")
        json_out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    cfg = as_config(_compose(argv))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    summary = run(cfg)  # leaves the default process group up (only the layout's sub-groups are destroyed)
    vocab = check_vocab_size(cfg.model.vocab_size, build_tokenizer(cfg.data).vocab_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_rank, dp_rank, pp_rank = rank_coordinates(rank, world, cfg.parallel.tensor_model_parallel_size,
                                                 cfg.parallel.pipeline_model_parallel_size)
    row = {"rank": rank, "tp": tp_rank, "pp": pp_rank, "dp": dp_rank,
           "predicted_gib": _prediction(cfg, {"tp": tp_rank, "pp": pp_rank}, vocab),
           "measured_peak_gib": torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"plan_check: model={cfg.model.name} parallel={cfg.parallel.name} precision={cfg.precision.name} "
              f"world={world} (GiB; predicted = model states + max(activations + logits, optimizer workspace))")
        print("rank tp pp dp | weights grads  main optim  acts logits | predicted measured  rel.err")
        for r in rows:
            p, meas = r["predicted_gib"], r["measured_peak_gib"]
            err = "   -" if meas is None else f"{(p['total'] - meas) / meas:+8.1%}"
            meas_txt = "      -" if meas is None else f"{meas:8.2f}"
            print(f"{r['rank']:>4} {r['tp']:>2} {r['pp']:>2} {r['dp']:>2} | {p['weights']:7.2f} {p['grads']:5.2f} "
                  f"{p['main_params']:5.2f} {p['optimizer_state']:5.2f} {p['activations']:5.2f} {p['logits']:6.2f} | "
                  f"{p['total']:9.2f} {meas_txt} {err}")
        out = {"config": {"model": cfg.model.name, "parallel": cfg.parallel.name, "precision": cfg.precision.name},
               "rows": rows, "summary": summary}
        path = Path(json_out) if json_out else Path(summary["run_dir"]) / "plan_check.json"
        path.write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
