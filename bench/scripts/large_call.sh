#!/usr/bin/env bash
# One device call (1 × H200) for issue 20's larger sizes: gpt_1.3b (shipped default) next to the compiled
# plain-PyTorch reference and megatron-core, gpt_1.3b at micro batch 8 × 2, gpt_6.7b with full recomputation.
# Usage (device, carry .whl with the megatron-core wheel): bash bench/scripts/large_call.sh $OUT CALL_ID
set -u
OUT=${1:?out dir}; CALL=${2:?call id}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 bench/run_bench.py --suite small --trainers mptrain --only s_gpt1.3b_mb4x4 --variants compile \
  --budget-s 200 --out "$OUT/results.jsonl" --call-id "$CALL" 2>&1 | tail -8
python3 bench/run_bench.py --suite full --trainers megatron-core --only b_gpt1.3b_bf16_tp1 \
  --budget-s 120 --out "$OUT/results.jsonl" --call-id "$CALL" 2>&1 | tail -6
echo "elapsed $(( $(date +%s) - t0 )) s"
common="parallel=tp1pp1 precision=bf16 data=mock data.vocab_size=50257 optim=adamw optim.lr=1e-4 optim.weight_decay=0.01
  train.clip_grad=1.0 train.eval_interval=null model.hidden_dropout=0.0 model.attention_dropout=0.0 run.progress_bar=false
  model.compile_layers=true"
run() {  # name, seconds, overrides...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/mptrain_entry.py $common run.dir=/tmp/$name "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(grep -h '^kernels:' "$OUT/$name.log" | cut -c1-160)"
  grep -h '^iter' "$OUT/$name.log" | grep -v 'times' | tail -4 | cut -c1-220
  cat /tmp/$name/bench_rank0.json 2>/dev/null; echo
}
run gpt6.7b_full_mb4 220 model=gpt_6.7b train.micro_batch_size=4 train.global_batch_size=16 train.train_iters=6 \
  model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1
echo "elapsed $(( $(date +%s) - t0 )) s"
run gpt1.3b_mb8x2 130 model=gpt_1.3b train.micro_batch_size=8 train.global_batch_size=16 train.train_iters=11
echo "elapsed $(( $(date +%s) - t0 )) s"
