#!/usr/bin/env bash
# Source on an offline GPU machine: installs the wheels in .whl/ (pinned transformers and the
# server/test dependencies) into /tmp/site and points the demo checkpoints at .cache/demo/.
if compgen -G ".whl/*.whl" >/dev/null; then  # none: the environment already has them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export VLLM_DEMO_DIR=$PWD/.cache/demo
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
