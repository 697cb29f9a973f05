#!/usr/bin/env bash
# GPU verification on an offline CUDA machine: install the wheels from .whl/ (pinned
# transformers and the server/test dependencies), then run the CUDA tests.
# Usage (from the repository root, with .whl/ and the demo checkpoints in .cache/demo/):
#   bash tools/gpu_check.sh [pytest paths...]
set -uo pipefail
source tools/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
TESTS=${*:-tests/kernels tests/model_executor/test_sampler.py tests/models tests/worker tests/engine}
python3 -m pytest -q -p no:cacheprovider --timeout 600 -rs $TESTS 2>&1 | tee "$OUT/pytest.log" | tail -40
