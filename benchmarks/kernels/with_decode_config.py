"""Runs a script or module with another default paged-decode config (to measure a tuning
before making it the default).

    python benchmarks/kernels/with_decode_config.py '{"block_n": 64, "min_chunk": 512}' \
        benchmarks/run_report.py --skip-hf ...
    python benchmarks/kernels/with_decode_config.py CONFIG_JSON -m pytest tests/models
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import sys

import vllm.attention.ops.triton_decode as triton_decode


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    changes = json.loads(sys.argv[1])
    cfg = dataclasses.replace(triton_decode.DEFAULT_DECODE_CONFIG, **changes)
    if cfg.num_segments != triton_decode.DEFAULT_DECODE_CONFIG.num_segments:
        raise SystemExit("num_segments sizes the workspace: change it in the source instead")
    triton_decode.DEFAULT_DECODE_CONFIG = cfg
    print(f"default decode config: {cfg}", flush=True)
    if sys.argv[2] == "-m":
        sys.argv = [sys.argv[3], *sys.argv[4:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
