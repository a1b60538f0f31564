#!/usr/bin/env bash
# Create (or reuse) .venv and install mptrain with its dev extra. Idempotent and quiet when done.
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
touch "$stamp"
