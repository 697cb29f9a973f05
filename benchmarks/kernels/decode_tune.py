"""Grid search of the paged decode knobs on the shapes a mixed decode step runs (CUDA only).

Times each candidate ``DecodeConfig`` on self decode (512 and 4,096 tokens at batch 1 and 64,
32,768 at batch 1) and cross decode (6,404 vision tokens at batch 1 and 32), then picks the config
that minimises the attention time of a batch-64 mixed step (32 self layers at 64 x 512, 8 cross
layers at 32 x 6,404) without making the batch-1 image step's attention (32 self layers at 512,
8 cross layers) more than ``--bs1-slack-us`` slower than the current default or any single point
more than 10% slower. The number of segments stays at the default (the workspace shape).
``--combine`` searches the combine kernel's knobs (segments per block, warps, stages) instead of
the segment kernel's.

    python -m benchmarks.kernels decode-tune [--combine] [--json PATH] [--bs1-slack-us 60]

A candidate is measured in the engine by making it the default in
``vllm/attention/ops/triton_decode.py`` and running ``python -m benchmarks.engine report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from benchmarks.common import copy_bandwidth_gb_s
from benchmarks.kernels.attention import CROSS_LEN, CROSS_PAGE, SELF_PAGE, bench_decode
from vllm.attention.ops.triton_decode import DEFAULT_DECODE_CONFIG, DecodeConfig

POINTS = {  # name: (kind, batch, kv_len, page)
    "self_1x512": ("self decode", 1, 512, SELF_PAGE),
    "self_64x512": ("self decode", 64, 512, SELF_PAGE),
    "self_1x4096": ("self decode", 1, 4096, SELF_PAGE),
    "self_64x4096": ("self decode", 64, 4096, SELF_PAGE),
    "self_1x32768": ("self decode", 1, 32768, SELF_PAGE),
    "cross_1": ("cross decode", 1, CROSS_LEN, CROSS_PAGE),
    "cross_32": ("cross decode", 32, CROSS_LEN, CROSS_PAGE),
}


def candidates(combine: bool = False) -> list[DecodeConfig]:
    """The configs searched, the default first: the segment kernel's grid, or the combine kernel's
    with ``combine``."""
    base = DEFAULT_DECODE_CONFIG
    out = [base]
    if combine:
        for sb, w, st in itertools.product((4, 8, 16, 32, 64), (1, 2, 4), (2,)):
            cfg = dataclasses.replace(
                base, combine_segments=sb, combine_num_warps=w, combine_num_stages=st
            )
            if cfg != base:
                out.append(cfg)
        return out
    # Shared memory bounds how many programs an SM holds (stages x block_n x head_dim x 2 tiles),
    # which is what limits short contexts at large batch: small tiles and few stages included.
    for bn, mc, w, st in itertools.product((32, 64), (128, 256), (2, 4), (1, 2, 3)):
        if mc < bn:
            continue
        cfg = dataclasses.replace(base, block_n=bn, min_chunk=mc, num_warps=w, num_stages=st)
        if cfg != base:
            out.append(cfg)
    return out


def step_us(t: dict[str, float]) -> tuple[float, float]:
    """(batch-64 mixed, batch-1 image) attention microseconds per decode step."""
    return (32 * t["self_64x512"] + 8 * t["cross_32"], 32 * t["self_1x512"] + 8 * t["cross_1"])


def measure(cfg: DecodeConfig, copy_gb_s: float) -> dict | None:
    """Every point at ``cfg`` (None when the compiler rejects the config)."""
    try:
        t = {name: bench_decode(*p[:3], p[3], cfg, copy_gb_s).time_us for name, p in POINTS.items()}
    except Exception as exc:  # a config the compiler rejects (resources): skip it
        print(f"skip {cfg}: {type(exc).__name__}: {exc}")
        return None
    mixed, bs1 = step_us(t)
    print(
        f"bn={cfg.block_n:3d} mc={cfg.min_chunk:3d} w={cfg.num_warps} st={cfg.num_stages}"
        f" cb={cfg.combine_segments} cw={cfg.combine_num_warps} cs={cfg.combine_num_stages}"
        f"  mixed64 {mixed:7.0f} us  bs1 {bs1:6.0f} us  "
        + " ".join(f"{k}={v:.1f}" for k, v in t.items()),
        flush=True,
    )
    return {"config": dataclasses.asdict(cfg), "us": t, "mixed64_us": mixed, "bs1_image_us": bs1}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Times every candidate; prints the best one that keeps batch 1 within the slack."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--bs1-slack-us", type=float, default=60.0)
    ap.add_argument("--combine", action="store_true", help="search the combine kernel's knobs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the decode tuning needs a CUDA device")
    torch.manual_seed(0)
    copy_gb_s = copy_bandwidth_gb_s()
    results = [r for r in (measure(c, copy_gb_s) for c in candidates(args.combine)) if r]
    base = results[0]
    ok = [
        r
        for r in results
        if r["bs1_image_us"] <= base["bs1_image_us"] + args.bs1_slack_us
        and all(r["us"][k] <= 1.1 * base["us"][k] for k in POINTS if k != "self_64x512")
    ]
    best = min(ok, key=lambda r: r["mixed64_us"])
    print("BEST " + json.dumps(best["config"], separators=(",", ":")))
    print(
        f"mixed64 attention {base['mixed64_us']:.0f} -> {best['mixed64_us']:.0f} us per step;"
        f" bs1 image {base['bs1_image_us']:.0f} -> {best['bs1_image_us']:.0f} us"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "copy_gb_s": copy_gb_s,
                    "results": results,
                    "best": best,
                },
                f,
                indent=1,
            )
