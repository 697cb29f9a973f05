"""Paged self/cross decode time against segments per program and page size (CUDA only).

For each point (batch, KV length, page size) times the decode with every power-of-two fold
(``segs_per_program``) and the fold the default policy picks, so the policy's
``target_programs`` can be checked against the best fold per batch size.

    python benchmarks/kernels/sweep_decode_fold.py [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from benchmark_attention import CROSS_LEN, CROSS_PAGE, bench_decode, copy_bandwidth_gb_s

from vllm.attention.ops.triton_decode import DEFAULT_DECODE_CONFIG, segments_per_program

POINTS = [  # (kind, batch, kv_len, page)
    ("self decode", 1, 512, 16),
    ("self decode", 8, 512, 16),
    ("self decode", 32, 512, 16),
    ("self decode", 64, 512, 16),
    ("self decode", 64, 512, 64),
    ("self decode", 128, 512, 16),
    ("self decode", 64, 4096, 16),
    ("self decode", 64, 4096, 64),
    ("self decode", 1, 32768, 16),
    ("cross decode", 1, CROSS_LEN, CROSS_PAGE),
    ("cross decode", 32, CROSS_LEN, CROSS_PAGE),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = DEFAULT_DECODE_CONFIG
    copy_gb_s = copy_bandwidth_gb_s()
    rows = []
    for kind, batch, kv_len, page in POINTS:
        policy = segments_per_program(batch, 8, cfg)
        spp = 1
        while spp <= cfg.num_segments:
            r = bench_decode(kind, batch, kv_len, page, cfg, copy_gb_s, spp=spp)
            rows.append({**dataclasses.asdict(r), "page": page, "spp": spp,
                         "policy": spp == policy})
            print(f"{kind:12s} b={batch:3d} len={kv_len:5d} page={page:2d} spp={spp:2d}"
                  f"{' *' if spp == policy else '  '} {r.time_us:8.1f} us {r.pct_of_copy:5.1f}%",
                  flush=True)
            spp *= 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gb_s": copy_gb_s, "config": dataclasses.asdict(cfg), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
