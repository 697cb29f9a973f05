#!/usr/bin/env bash
# Downloads, on a machine with PyPI access, the pure-Python (and a few binary) wheels an
# offline CUDA machine with Python 3.12, torch and triton needs for the tests and benchmarks:
# the pinned transformers stack and the server dependencies. Then copy .whl/ and the demo
# checkpoints (VLLM_DEMO_DIR=.cache/demo python -m vllm.transformers_utils.demo_checkpoints
# demo/mllama-11b) to that machine and `source tools/gpu_env.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(transformers==5.24.0 huggingface-hub==2.4.0 tokenizers==0.23.3 hf-xet==1.8.0
      httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20 typer==0.29.2
      shellingham==1.5.4 rich==15.0.0 click==8.5.1 typing_extensions==4.16.0 anyio==4.16.0
      h11==0.16.0 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
      opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic-core==2.50.5
      typing-inspection==0.4.5 annotated-types==0.8.0 uvicorn==0.54.0 openai==3.57.0
      jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 hypothesis==6.170.17
      sortedcontainers==2.4.0 pytest-timeout==2.4.0
      compressed-tensors==0.20.1 loguru==0.7.3 psutil==7.2.2
      xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${PKGS[@]}"
