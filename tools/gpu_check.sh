#!/usr/bin/env bash
# GPU verification in one call: install the carried wheels (pinned transformers and the
# server/test dependencies), run the CUDA tests, then the attention microbenchmark.
# Usage (from the repository root, with .whl/ and .cache/demo/ carried):
#   bash tools/gpu_check.sh [pytest paths...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export VLLM_DEMO_DIR=$PWD/.cache/demo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
TESTS=${*:-tests/kernels tests/model_executor/test_sampler.py tests/models tests/worker tests/engine}
python3 -m pytest -q -p no:cacheprovider --timeout 600 -rs $TESTS 2>&1 | tee "$OUT/pytest.log" | tail -40
