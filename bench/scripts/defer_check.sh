#!/usr/bin/env bash
# One device call (1 × H200) after train.defer_step_read: the GPU exactness tests, 124M with
# checkpoint.save set (the per-iteration stop-flag check over gloo must not drain the device), and a
# torch.profiler table of the 124M default run.
# Usage (device, carry .whl): bash bench/scripts/defer_check.sh $OUT
set -u
OUT=${1:?out dir}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_compile_chunk.py tests/test_gpu_kernels.py \
  tests/test_gpu_deferred_step.py -W ignore::DeprecationWarning 2>&1 | tail -4
S124="model=gpt_125m model.num_layers=12 model.hidden_size=768 model.num_attention_heads=12 model.seq_length=1024
  parallel=tp1pp1 precision=bf16 data=mock data.vocab_size=50257 optim=adamw optim.lr=1e-4 optim.weight_decay=0.01
  train.clip_grad=1.0 train.micro_batch_size=12 train.global_batch_size=12 train.train_iters=13 train.eval_interval=null
  model.hidden_dropout=0.0 model.attention_dropout=0.0 run.progress_bar=false model.compile_layers=true"
run() {  # name, overrides...
  local name=$1; shift
  timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/mptrain_entry.py $S124 \
    run.dir=/tmp/$name "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -h '^iter' "$OUT/$name.log" | grep -v times | sed -n '4,13p' | grep -o 'tokens/s [0-9.]*' | tr '\n' ' '; echo
}
run gpt124m_ckpt checkpoint.save=/tmp/ck124 checkpoint.save_interval=1000
run gpt124m_default
run gpt124m_profile --bench-profile "$OUT/profile_s_gpt124m_s1024_mb12-compile-call20261201d4.txt"
head -12 "$OUT/profile_s_gpt124m_s1024_mb12-compile-call20261201d4.txt"; grep -m1 "ProfilerStep" "$OUT/profile_s_gpt124m_s1024_mb12-compile-call20261201d4.txt" | cut -c1-40,150-260
