"""Decode-sized GEMMs of the 11B text decoder: cuBLAS, cuBLASLt and the Triton skinny GEMM.

For each weight shape a decode step reads (fused QKV, O, fused gate/up, down, LM head) and each
row count, times y = x @ W^T as CUDA-graph replays of back-to-back calls, each on the next of
several weight copies (so no weight is served from L2), and reports the time, the fraction of
copy bandwidth (weight + activation bytes), the kernels launched per call (cuBLAS adds split-K
reduction kernels) and, for Triton, the best config of a sweep. ``--silu``: the gate/up GEMM
with SiLU-and-multiply, cuBLASLt + ``silu_and_mul`` against the Triton GEMM with the
activation in its epilogue. (Kernels are counted with torch.profiler, which slows later graph
launches of the process: the launch cost is ``python -m benchmarks.kernels launch``.)

    python -m benchmarks.kernels gemm [--rows 1,16,32,64,128] [--shapes qkv,o_proj]
        [--no-sweep] [--silu] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
from collections.abc import Callable

import torch
import triton

from benchmarks.common import copy_bandwidth_gb_s
from vllm.model_executor.layers.fused_kernels import silu_and_mul
from vllm.model_executor.layers.skinny_gemm import (
    GemmConfig,
    default_config,
    skinny_gemm,
    skinny_gemm_silu,
)

SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
L2_BYTES = 50 << 20
CALLS = 24


def time_calls(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Microseconds per call: CALLS calls cycling over ``weights``, captured and replayed."""
    seq = [weights[i % len(weights)] for i in range(CALLS)]
    for w in seq[: len(weights)]:
        fn(w)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in seq:
            fn(w)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def kernels_per_call(fn: Callable[[], object]) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def sweep_configs(m: int) -> list[GemmConfig]:
    block_ms = [16] if m <= 16 else ([32] if m <= 32 else ([64] if m <= 64 else [64, 128]))
    out = []
    for bm, bn, bk, st in itertools.product(block_ms, [16, 32, 64, 128], [128, 256], [3, 5]):
        if bm * bk * 2 + bn * bk * 2 > 64 << 10:
            continue
        out.append(GemmConfig(bm, bn, bk, num_warps=8 if bm * bn >= 8192 else 4, num_stages=st))
    return out


def fastest_config(
    configs: list[GemmConfig],
    k: int,
    run: Callable[[torch.Tensor, GemmConfig], object],
    weights: list[torch.Tensor],
) -> tuple[float, GemmConfig] | None:
    """(us, config) of the fastest config that divides K and launches, or None."""
    best: tuple[float, GemmConfig] | None = None
    for c in configs:
        if k % c.block_k:
            continue
        try:
            us = time_calls(lambda w, c=c: run(w, c), weights)
        except Exception as exc:  # out of shared memory and the like: skip the config
            print(f"  skip {c}: {type(exc).__name__}")
            continue
        if best is None or us < best[0]:
            best = (us, c)
    return best


def _entry(us: float, nbytes: int, copy_gb_s: float, **extra: object) -> dict:
    pct = 100.0 * nbytes / (us * 1e-6) / 1e9 / copy_gb_s
    return {"us": round(us, 2), "pct_copy": round(pct, 1), **extra}


def _fmt(e: dict) -> str:
    return f"{e['us']:8.1f} us {e['pct_copy']:5.1f}%"


def bench_row(x: torch.Tensor, weights: list[torch.Tensor], copy_gb_s: float, sweep: bool) -> dict:
    """All variants for one [M, K] input against the [N, K] weight copies."""
    m, k = x.shape
    n = weights[0].shape[0]
    nbytes = n * k * 2 + (m * k + m * n) * 2
    row: dict = {"n": n, "k": k, "m": m}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        us = time_calls(lambda w: torch.nn.functional.linear(x, w), weights)
        count = kernels_per_call(lambda: torch.nn.functional.linear(x, weights[0]))
        row[lib] = _entry(us, nbytes, copy_gb_s, kernels=count)
    torch.backends.cuda.preferred_blas_library("cublas")
    ref = x.float() @ weights[0].float().T
    cfg = default_config(m, n, k)
    err = (skinny_gemm(x, weights[0], cfg).float() - ref).abs().max().item()
    us = time_calls(lambda w: skinny_gemm(x, w, cfg), weights)
    row["triton_default"] = _entry(
        us, nbytes, copy_gb_s, config=dataclasses.asdict(cfg), max_abs_err=err
    )
    if not sweep:
        return row
    best = fastest_config(sweep_configs(m), k, lambda w, c: skinny_gemm(x, w, c), weights)
    if best is not None:
        row["triton_best"] = _entry(best[0], nbytes, copy_gb_s, config=dataclasses.asdict(best[1]))
    return row


def bench_shape(
    name: str, n: int, k: int, rows: list[int], copy_gb_s: float, sweep: bool, log: list[dict]
) -> None:
    """Every row count of one weight shape: printed, and appended to ``log``."""
    copies = max(1, -(-3 * L2_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"shape": name, **bench_row(x, weights, copy_gb_s, sweep)}
        log.append(row)
        best = row.get("triton_best")
        print(
            f"{name:8s} m={m:4d}  cublas {_fmt(row['cublas'])} ({row['cublas']['kernels']}k)"
            f"  lt {_fmt(row['cublaslt'])} ({row['cublaslt']['kernels']}k)"
            f"  triton {_fmt(row['triton_default'])}"
            f"  best {_fmt(best) + ' ' + str(best['config']) if best else '-'}"
            f"  err {row['triton_default']['max_abs_err']:.2e}",
            flush=True,
        )
    del weights
    torch.cuda.empty_cache()


def bench_silu(rows: list[int], copy_gb_s: float, sweep: bool, log: list[dict]) -> None:
    """gate|up GEMM + SiLU-and-multiply: cuBLASLt's GEMM then ``silu_and_mul`` (two kernels,
    what decode ran before) against the Triton GEMM with the activation in its epilogue."""
    n2, k = SHAPES["gate_up"]
    copies = max(1, -(-3 * L2_BYTES // (n2 * k * 2)))
    weights = [
        torch.randn(n2, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
    ]
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = n2 * k * 2 + (m * k + m * n2 // 2) * 2
        torch.backends.cuda.preferred_blas_library("cublaslt")
        base = _entry(
            time_calls(lambda w, x=x: silu_and_mul(torch.nn.functional.linear(x, w)), weights),
            nbytes,
            copy_gb_s,
        )
        ref = silu_and_mul(torch.nn.functional.linear(x, weights[0])).float()
        torch.backends.cuda.preferred_blas_library("cublas")
        row = {"shape": "gate_up+silu", "m": m, "cublaslt+silu_and_mul": base}
        configs = sweep_configs(m) if sweep else [default_config(m, n2 // 2, k)]
        best = fastest_config(configs, k, lambda w, c, x=x: skinny_gemm_silu(x, w, c), weights)
        if best is not None:
            err = (skinny_gemm_silu(x, weights[0], best[1]).float() - ref).abs().max().item()
            row["triton_silu_best"] = _entry(
                best[0],
                nbytes,
                copy_gb_s,
                config=dataclasses.asdict(best[1]),
                max_abs_err_vs_base=err,
            )
        log.append(row)
        tb = row.get("triton_silu_best")
        print(
            f"gate_up+silu m={m:4d}  lt+silu {_fmt(base)}  fused "
            f"{_fmt(tb) + ' ' + str(tb['config']) if tb else '-'}",
            flush=True,
        )
    del weights
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Runs the shapes (or ``--silu``); prints a line per point."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,32,64,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--silu",
        action="store_true",
        help="only the gate|up GEMM with and without the fused SiLU epilogue",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the GEMM benchmark needs a CUDA device")
    rows = [int(r) for r in args.rows.split(",")]
    copy_gb_s = copy_bandwidth_gb_s()
    print(
        f"copy bandwidth {copy_gb_s:.0f} GB/s; torch {torch.__version__},"
        f" triton {triton.__version__}"
    )
    gemms: list[dict] = []
    if args.silu:
        bench_silu(rows, copy_gb_s, not args.no_sweep, gemms)
    else:
        for name in filter(None, args.shapes.split(",")):
            n, k = SHAPES[name]
            bench_shape(name, n, k, rows, copy_gb_s, not args.no_sweep, gemms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "copy_gb_s": copy_gb_s,
                    "gemm": gemms,
                },
                f,
                indent=1,
            )
