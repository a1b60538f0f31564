#!/usr/bin/env bash
# Device check (2 × H200, NCCL) of how a one-rank failure ends a job (issue 10 "Reliability", issue 9).
# Usage (device, carry .whl): bash bench/scripts/nccl_failure_check.sh $OUT
# Prints, per scenario: exit code, wall seconds from launch, metrics rows, and the error lines.
set -u
OUT=${1:?out}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/hydra_core* .whl/omegaconf* .whl/antlr4* >/dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD/src" OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py model=tiny parallel=tp2pp1 train.eval_interval=null run.progress_bar=false"
go() {  # name args...
  local name=$1; shift
  local t0=$(date +%s.%N)
  timeout 170 $TR "$@" run.dir=/tmp/r_$name > $OUT/$name.log 2>&1
  local rc=$? t1=$(date +%s.%N)
  local rows=$(wc -l < /tmp/r_$name/metrics.jsonl 2>/dev/null)
  echo "=== $name rc=$rc wall=$(python3 -c "print(round($t1-$t0,1))") s rows=$rows"
  grep -E "^error:|job failed|Sending process|forcefully|Watchdog caught|timed out|Timeout" $OUT/$name.log | cut -c1-260 | head -12
}
# 1. a peer dies (rank 1 raises at iteration 3): rank 0, blocked in an NCCL wait, gets torchrun's SIGTERM
go died train.train_iters=2000 debug.fail_rank=1 debug.fail_iteration=3
# 2. a stalled peer with train.step_timeout_s=10 (NCCL timeout, then the StepWatchdog backstop at 20 s)
go stall train.train_iters=6 train.step_timeout_s=10 debug.sleep_rank=1 debug.sleep_seconds=100
# 3. a plain SIGTERM: finish the step, save, exit 0 on every worker
$TR train.train_iters=100000 checkpoint.save=/tmp/ck run.dir=/tmp/r_sig > $OUT/sigterm.log 2>&1 &
P=$!
for i in $(seq 1 240); do n=$(wc -l < /tmp/r_sig/metrics.jsonl 2>/dev/null || echo 0); [ "$n" -ge 20 ] && break; sleep 0.5; done
t0=$(date +%s.%N); kill -TERM $P; wait $P; rc=$?
echo "=== sigterm rc=$rc wall_after_signal=$(python3 -c "print(round($(date +%s.%N)-$t0,1))") s latest=$(cat /tmp/ck/latest 2>/dev/null)"
grep -E "^error:|forcefully|exitcode|Traceback" $OUT/sigterm.log | head -5
