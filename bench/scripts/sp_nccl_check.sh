#!/usr/bin/env bash
# Device check (2 GPUs, NCCL): sequence parallelism's input-grad reduce-scatter on NCCL (the async
# `reduce_scatter_tensor` path of layers/mappings.start_grad_collective; gloo tests use an
# all-reduce fallback) gives the same losses as tp2 without SP, eager and compiled.
# Usage (device, carry .whl): bash bench/scripts/sp_nccl_check.sh $OUT
set -u
OUT=${1:?out}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/hydra_core* .whl/omegaconf* .whl/antlr4* >/dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD/src" OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py model=tiny model.seq_length=64 parallel=tp2pp1 precision=fp32 data=mock train.train_iters=6 train.eval_interval=null run.progress_bar=false model.hidden_dropout=0.0 model.attention_dropout=0.0"
run() { local name=$1; shift; timeout 100 $TR "$@" run.dir=/tmp/sp_$name > $OUT/sp_$name.log 2>&1; echo "$name rc=$?"; }
run plain parallel.sequence_parallel=false
run sp parallel.sequence_parallel=true
run sp_noasync parallel.sequence_parallel=true parallel.async_tensor_model_parallel_allreduce=false
run sp_compile parallel.sequence_parallel=true model.compile_layers=true
python3 - <<'PY'
import json
rows = {}
for name in ("plain", "sp", "sp_noasync", "sp_compile"):
    try:
        rows[name] = [json.loads(l)["lm_loss"] for l in open(f"/tmp/sp_{name}/metrics.jsonl") if '"train"' in l]
    except Exception as e:
        rows[name] = repr(e)
ref = rows["plain"]
for name, r in rows.items():
    diff = max(abs(a - b) for a, b in zip(r, ref)) if isinstance(r, list) and isinstance(ref, list) and r else None
    print(json.dumps({"run": name, "lm_loss": r, "max_abs_diff_vs_plain": diff}))
PY
