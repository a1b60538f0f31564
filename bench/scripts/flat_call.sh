#!/usr/bin/env bash
# Device call (1 × H200) for the flat Adam step (precision.flat_adam_step): the optimizer microbench at
# gpt_1.3b, the GPU tests, then end-to-end A/Bs (compile vs compile_flat) in the same call.
# Usage (device, carry .whl): [CONFIGS=...] [VARIANTS=compile,compile_flat] [TESTS=files] [MICRO=0] \
#   bash bench/scripts/flat_call.sh $OUT CALL_ID [ITERS]
set -u
OUT=${1:?out dir}; CALL=${2:?call id}; ITERS=${3:-20}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
[ "${DIAG:-0}" = 1 ] && python3 bench/flat_adam_diag.py 2>&1 | tail -3 | cut -c1-1500
if [ "${MICRO:-1}" = 1 ]; then
  python3 bench/flat_adam_bench.py --model gpt_1.3b --out "$OUT/flat_adam_${CALL}.jsonl" 2>&1 | tail -5 | cut -c1-400
  echo "micro done at $(( $(date +%s) - t0 )) s"
fi
if [ -n "${TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider $TESTS -W ignore::DeprecationWarning 2>&1 | tail -15 | cut -c1-300
  echo "tests done at $(( $(date +%s) - t0 )) s"
fi
if [ -n "${CONFIGS:-}" ]; then
  python3 bench/run_bench.py --suite small --trainers mptrain --iters "$ITERS" --out "$OUT/results.jsonl" \
    --call-id "$CALL" --budget-s "$(left)" --only "$CONFIGS" --variants "${VARIANTS:-compile,compile_flat}" ${BENCH_ARGS:-} 2>&1 \
    | grep -E '^(---|===|\s*s_gpt|[a-z_-]+ +s_gpt)|tok/s|ok|fail|timeout|rror' | cut -c1-220
  python3 - "$OUT/results.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["trainer"], r["config"], r["variant"], r.get("status"), r.get("tokens_per_s_per_gpu"), r.get("mfu"),
          r.get("tokens_per_s_per_gpu_steady"), r.get("mfu_steady"), r.get("peak_mem_gib"), r.get("loss_max_abs_diff_vs_base"))
PY
fi
echo "elapsed $(( $(date +%s) - t0 )) s"
