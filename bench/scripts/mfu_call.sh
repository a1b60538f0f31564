#!/usr/bin/env bash
# One device call (1 × H200) for issue 20's 60 % MFU target at gpt_1.3b: the shipped default split
# (micro batch 4 × 4) over a long window with its kernel profile and the plain-PyTorch reference, variants
# (VARIANTS) of the default split, the other splits of the same global batch (8 × 2, 16 × 1), then TESTS.
# Usage (device, carry .whl): [SPLITS=0|configs] [DEFAULT=0] [VONLY=configs] [TESTS=files] [BUDGET=s] bash bench/scripts/mfu_call.sh $OUT CALL_ID [ITERS] [VARIANTS]
set -u
OUT=${1:?out dir}; CALL=${2:?call id}; ITERS=${3:-30}; VARIANTS=${4:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - $(date +%s) + t0 )); }
bench() { python3 bench/run_bench.py --suite small --trainers mptrain --iters "$ITERS" --out "$OUT/results.jsonl" \
  --call-id "$CALL" --budget-s "$(left)" "$@" 2>&1 | grep -E '^(---|===|\s*s_gpt|[a-z_-]+ +s_gpt)|tok/s|ok|fail|timeout' | cut -c1-220; }
[ "${DEFAULT:-1}" = 1 ] && bench --only s_gpt1.3b_mb4x4 --variants compile --profile compile
[ -n "$VARIANTS" ] && bench --only "${VONLY:-s_gpt1.3b_mb4x4}" --variants "$VARIANTS" --no-reference
SPLITS=${SPLITS:-s_gpt1.3b_mb8x2,s_gpt1.3b_mb16x1}
[ "$SPLITS" != 0 ] && bench --only "$SPLITS" --variants compile
if [ -n "${TESTS:-}" ]; then
  timeout "$(( $(left) > 30 ? $(left) : 30 ))" python3 -m pytest -q -p no:cacheprovider $TESTS -W ignore::DeprecationWarning 2>&1 | tail -6
fi
for f in "$OUT"/bench_logs/"$CALL"/profile_*.txt; do [ -f "$f" ] && head -64 "$f" | cut -c1-200; done
python3 - "$OUT/results.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["trainer"], r["config"], r["variant"], r.get("status"), r.get("tokens_per_s_per_gpu"), r.get("mfu"),
          r.get("iter_s_median"), r.get("iter_s_max"), r.get("peak_mem_gib"))
PY
echo "elapsed $(( $(date +%s) - t0 )) s"
