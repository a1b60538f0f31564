#!/usr/bin/env bash
# Create (or reuse) .venv and install mptrain with its dev extra, its fp8 extra beside it (.venv/fp8-site).
# Idempotent and quiet when done.
# On a CPU-only machine torch is installed first as a CPU build, so that pip never pulls a multi-GB
# CUDA build the CPU build already serves.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.mptrain-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q torch
  else
    # this machine kind keeps torch 2.13.0 (CPU build) on local disk; elsewhere use PyTorch's CPU index
    "$VENV/bin/pip" install -q torch==2.13.0 2>/dev/null \
      || "$VENV/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$VENV/bin/pip" install -q -e ".[dev]"
# The fp8 extra (torchao) goes into a folder beside the venv's packages, which `make test` alone puts on
# PYTHONPATH: installed in the venv, transformers would import it in every process that loads a model,
# and torchao's import logs warnings there.
fp8=$("$VENV/bin/python" -c 'import importlib.metadata as m
print(" ".join(r.split(";")[0] for r in m.requires("mptrain") or () if r.endswith("extra == \"fp8\"")))')
rm -rf "$VENV/fp8-site"
"$VENV/bin/pip" install -q --no-deps --target "$VENV/fp8-site" $fp8
touch "$stamp"
