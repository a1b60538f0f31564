#!/usr/bin/env bash
# One device call (2 × H200): kernel time split + top kernels of mptrain's best variant and of the
# megatron-core peer on the weakest rows (seed fp32+TF32 tp2, seed bf16 tp2) and of gpt_1.3b 1 GPU.
# Usage (device, carry .whl): bash bench/scripts/profile_call.sh $OUT
set -u
OUT=${1:?out dir}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
L=$OUT/prof; mkdir -p $L
TR="python3 -m torch.distributed.run --standalone"
COMMON="data=mock data.vocab_size=50257 optim=adamw optim.lr=1e-4 optim.weight_decay=0.01 train.clip_grad=1.0 train.eval_interval=null model.hidden_dropout=0.0 model.attention_dropout=0.0 run.progress_bar=false"
SEED="model=seed_2.8b parallel=tp2pp1 train.micro_batch_size=8 train.global_batch_size=8 train.train_iters=8"
PSEED="--tp 2 --pp 1 --num-layers 12 --hidden-size 4096 --num-heads 8 --seq-length 1024 --vocab-size 50257 --micro-batch-size 8 --num-microbatches 1 --warmup 2 --iters 6"
run() { local name=$1; shift; echo "=== $name $(date +%T)"; timeout 170 "$@" > $L/$name.log 2>&1; echo "rc=$? $(date +%T)"; }
run m_fp32 $TR --nproc_per_node=2 bench/mptrain_entry.py --bench-profile $L/prof_m_fp32.txt $SEED precision=fp32 precision.allow_tf32=true model.attention_backend=unfused model.compile_layers=true $COMMON run.dir=$L/m_fp32
run p_fp32 $TR --nproc_per_node=2 bench/profile_wrap.py $L/prof_p_fp32.txt bench/peer/peer_megatron.py $PSEED --dtype fp32 --tf32 --out $L/p_fp32.jsonl
run m_bf16 $TR --nproc_per_node=2 bench/mptrain_entry.py --bench-profile $L/prof_m_bf16.txt $SEED precision=bf16 model.compile_layers=true $COMMON run.dir=$L/m_bf16
run p_bf16 $TR --nproc_per_node=2 bench/profile_wrap.py $L/prof_p_bf16.txt bench/peer/peer_megatron.py $PSEED --dtype bf16 --out $L/p_bf16.jsonl
run m_1b $TR --nproc_per_node=1 bench/mptrain_entry.py --bench-profile $L/prof_m_1b.txt model=gpt_1.3b parallel=tp1pp1 train.micro_batch_size=4 train.global_batch_size=16 train.train_iters=8 precision=bf16 model.compile_layers=true $COMMON run.dir=$L/m_1b
for f in $L/prof_*.txt; do echo "##### $f"; head -16 $f; done
cd $OUT && tar czf prof.tgz prof && rm -rf prof
