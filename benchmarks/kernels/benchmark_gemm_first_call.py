"""Host cost of the first GEMM at a new row count: the prefill linears of the 11B text model
(fused QKV, output, fused gate/up, down) at row counts the run has not seen, called the way a
prefill step calls them (``F.linear`` on bf16 activations, default BLAS library).

Each mode runs in its own process, so CUDA's module loading setting takes effect:
``lazy`` (CUDA's default: a kernel's module loads on its first launch), ``eager``
(``CUDA_MODULE_LOADING=EAGER``: every module loads when its library does) and ``bucketed``
(lazy, rows padded up to a multiple of ``--bucket`` after one call per bucket and shape).
Reported per mode: process start to first GEMM (library load), device memory in use then,
calls over 1 ms of host time, their total and the longest.

Usage: ``python benchmarks/kernels/benchmark_gemm_first_call.py [--out FILE.json]``
(``--smoke``: small shapes, CPU-friendly).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

SHAPES_11B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}
SHAPES_SMOKE = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
MODES = ("lazy", "eager", "bucketed")


def _rows(count: int, lo: int, hi: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(lo, hi), count)


def run_mode(mode: str, rows: list[int], shapes: dict[str, tuple[int, int]], bucket: int,
             max_rows: int) -> dict:
    """One mode in this process (the caller set the environment)."""
    start = time.perf_counter()
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    weights = {k: torch.randn(n, kk, device=device, dtype=dtype) * 0.02
               for k, (n, kk) in shapes.items()}
    widest = max(kk for _, kk in shapes.values())
    x_all = torch.randn(max_rows, widest, device=device, dtype=dtype)
    sync()
    # One small GEMM per shape: the BLAS library loads here, as in any model's first step.
    for w in weights.values():
        F.linear(x_all[:1, :w.shape[1]], w)
    sync()
    init_s = time.perf_counter() - start
    used = (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]) if cuda else 0

    def padded(m: int) -> int:
        return -(-m // bucket) * bucket if mode == "bucketed" else m

    warm_s, warm_calls = 0.0, 0
    if mode == "bucketed":
        t0 = time.perf_counter()
        for b in range(bucket, max_rows + 1, bucket):
            for w in weights.values():
                F.linear(x_all[:b, :w.shape[1]], w)
                warm_calls += 1
        sync()
        warm_s = time.perf_counter() - t0
    calls = []
    for m in rows:
        for name, w in weights.items():
            x = x_all[:padded(m), :w.shape[1]]
            sync()
            t0 = time.perf_counter()
            F.linear(x, w)
            host_ms = (time.perf_counter() - t0) * 1e3
            sync()
            calls.append((m, name, host_ms))
    slow = [c for c in calls if c[2] > 1.0]
    return {
        "mode": mode, "init_s": round(init_s, 3), "device_mem_used_gib": round(used / 2**30, 3),
        "warm_up_s": round(warm_s, 3), "warm_up_calls": warm_calls, "calls": len(calls),
        "slow_calls": len(slow), "slow_total_ms": round(sum(c[2] for c in slow), 2),
        "slowest": sorted(slow, key=lambda c: -c[2])[:8],
        "median_host_ms": round(sorted(c[2] for c in calls)[len(calls) // 2], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=60, help="new row counts to try")
    ap.add_argument("--min-rows", type=int, default=100)
    ap.add_argument("--max-rows", type=int, default=700)
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.min_rows, args.max_rows, args.bucket = 6, 3, 40, 16
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_11B
    max_rows = -(-args.max_rows // args.bucket) * args.bucket
    rows = _rows(args.rows, args.min_rows, args.max_rows, args.seed)
    if args.child:
        print(json.dumps(run_mode(args.child, rows, shapes, args.bucket, max_rows)))
        return
    results = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        env = dict(os.environ, CUDA_MODULE_LOADING="EAGER" if mode == "eager" else "LAZY")
        cmd = [sys.executable, __file__, "--child", mode, "--rows", str(args.rows),
               "--min-rows", str(args.min_rows), "--max-rows", str(args.max_rows),
               "--bucket", str(args.bucket), "--seed", str(args.seed)]
        if args.smoke:
            cmd.append("--smoke")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"mode {mode} failed:\n{done.stderr[-2000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "shapes": shapes, "bucket": args.bucket, "max_rows": max_rows,
                       "results": results}, f, indent=1)
    print(f"{len(rows)} new row counts in [{args.min_rows}, {args.max_rows}) x {len(shapes)} "
          f"shapes; host ms per call")
    print(f"  {'mode':9} {'init s':>7} {'mem GiB':>8} {'warm s':>7} {'median':>7} "
          f"{'>1 ms':>6} {'total ms':>9}  slowest (rows, shape, ms)")
    for r in results:
        top = ", ".join(f"({m}, {n}, {t:.1f})" for m, n, t in r["slowest"][:3])
        print(f"  {r['mode']:9} {r['init_s']:7.2f} {r['device_mem_used_gib']:8.2f} "
              f"{r['warm_up_s']:7.2f} {r['median_host_ms']:7.3f} {r['slow_calls']:6d} "
              f"{r['slow_total_ms']:9.1f}  {top}")


if __name__ == "__main__":
    main()
