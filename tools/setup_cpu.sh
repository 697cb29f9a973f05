#!/usr/bin/env bash
# Creates .venv with a CPU build of torch and this package installed in editable mode.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -c constraints.txt -r requirements-cpu.txt -r requirements-test.txt
pip install -q --no-deps --no-build-isolation -e .
