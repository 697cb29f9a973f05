#!/usr/bin/env bash
# GPU verification in one call: install the carried wheels (pinned transformers and the
# server/test dependencies), run the CUDA tests, then the attention microbenchmark.
# Usage (from the repository root, with .whl/ and .cache/demo/ carried):
#   bash tools/gpu_check.sh [pytest paths...]
set -uo pipefail
source tools/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
TESTS=${*:-tests/kernels tests/model_executor/test_sampler.py tests/models tests/worker tests/engine}
python3 -m pytest -q -p no:cacheprovider --timeout 600 -rs $TESTS 2>&1 | tee "$OUT/pytest.log" | tail -40
