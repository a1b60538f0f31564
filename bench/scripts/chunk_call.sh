#!/usr/bin/env bash
# One device call (1 × H200) for issue 20's compile_scope=chunk: the GPU exactness tests, then the
# small-suite rows (11M, 124M) for eager, per-layer compile, chunk compile and chunk + reduce-overhead,
# each next to the compiled plain-PyTorch reference in the same call.
# Usage (device, carry .whl): [TESTS=...] [SKIP_TESTS=1] bash bench/scripts/chunk_call.sh $OUT CALL_ID [ONLY] [VARIANTS] [BUDGET_S]
set -u
OUT=${1:?out dir}; CALL=${2:?call id}
ONLY=${3:-s_gpt11m_s256_mb64,s_gpt124m_s1024_mb12}; VARIANTS=${4:-base,compile_layer,compile}
BUDGET=${5:-470}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
TESTS=${TESTS:-tests/test_gpu_compile_chunk.py tests/test_gpu_kernels.py}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider $TESTS -W ignore::DeprecationWarning 2>&1 | tail -15
fi
python3 bench/run_bench.py --suite small --trainers mptrain --only "$ONLY" --variants "$VARIANTS" \
  --budget-s "$BUDGET" --out "$OUT/results.jsonl" --call-id "$CALL" 2>&1 | tail -40
