#!/usr/bin/env bash
# Device check (2 GPUs, NCCL): the trainer's loss trajectory at tp 2 (tiny model, mock data, dropout 0)
# equals plain eager tp 2's with model.compile_layers, with sequence parallelism (whose input-grad
# reduce-scatter, eager and async, only runs on NCCL: gloo tests use an all-reduce fallback), and both,
# fp32 and bf16.
# Usage (device, carry .whl): bash bench/scripts/compile_loss_check.sh $OUT [extra overrides...]
set -u
OUT=${1:?out}; shift
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/hydra_core* .whl/omegaconf* .whl/antlr4* >/dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD/src" OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py model=tiny model.seq_length=64 parallel=tp2pp1 data=mock train.train_iters=6 train.eval_interval=null run.progress_bar=false model.hidden_dropout=0.0 model.attention_dropout=0.0 precision.allow_tf32=false"
run() { local name=$1; shift; rm -rf /tmp/cl_$name; timeout 110 $TR "$@" $EXTRA_ARGS run.dir=/tmp/cl_$name > $OUT/cl_$name.log 2>&1; echo "$name rc=$?"; }
EXTRA_ARGS="$*"
run fp32_eager precision=fp32
run fp32_compile precision=fp32 model.compile_layers=true
run fp32_sp precision=fp32 parallel.sequence_parallel=true
run fp32_sp_noasync precision=fp32 parallel.sequence_parallel=true parallel.async_tensor_model_parallel_allreduce=false
run fp32_sp_compile precision=fp32 model.compile_layers=true parallel.sequence_parallel=true
run bf16_eager precision=bf16
run bf16_compile precision=bf16 model.compile_layers=true
python3 - <<'PY'
import json
rows = {}
for name in ("fp32_eager", "fp32_compile", "fp32_sp", "fp32_sp_noasync", "fp32_sp_compile", "bf16_eager", "bf16_compile"):
    try:
        rows[name] = [json.loads(l)["lm_loss"] for l in open(f"/tmp/cl_{name}/metrics.jsonl") if '"train"' in l]
    except Exception as e:
        rows[name] = repr(e)
for name, r in rows.items():
    ref = rows[name.split("_")[0] + "_eager"]
    diff = max(abs(a - b) for a, b in zip(r, ref)) if isinstance(r, list) and isinstance(ref, list) and r else None
    print(json.dumps({"run": name, "lm_loss": r, "max_abs_diff_vs_eager": diff}))
PY
