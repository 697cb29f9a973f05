#!/usr/bin/env bash
# Creates .venv with torch (the CPU build where it can be had) and this package installed in
# editable mode. Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The torch release the CPU suite runs on (tools/check_install_plan.py reads this line).
TORCH_PIN=torch==2.13.0
# PyTorch's index of CPU-only builds. Where it cannot be reached, torch comes from pip's own
# index: the default build (CUDA on Linux), which runs on a CPU as well but is several GB.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  if python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' \
      "$TORCH_CPU_INDEX/torch/" 2>/dev/null; then
    pip install -q --index-url "$TORCH_CPU_INDEX" "$TORCH_PIN"
  else
    echo "setup_cpu.sh: $TORCH_CPU_INDEX cannot be reached; $TORCH_PIN comes from pip's index" >&2
    pip install -q "$TORCH_PIN"
  fi
fi
pip install -q -c constraints.txt -r requirements-cpu.txt -r requirements-test.txt
pip install -q --no-deps --no-build-isolation -e .
