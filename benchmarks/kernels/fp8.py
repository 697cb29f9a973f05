"""The FP8 linears of one text layer: the Triton weight-only FP8 GEMM against bf16, the
dequantized scratch + cuBLAS, and torch._scaled_mm with per-token activation quantization.

For each projection a decode step runs (fused QKV, O, fused gate|up, down) and each row count,
times as CUDA-graph replays cycling over enough weight copies that every read comes from HBM
(``gemm.time_calls``):

- ``bf16``: ``F.linear`` on the bf16 weight (cuBLAS);
- ``fp8``: the Triton GEMM that converts the FP8 tile in registers and applies the channel
  scale in its epilogue, with the config the kernel table would choose (``decode_config``:
  this GPU's tuned table, else the default; absent where the table says scratch), and with
  ``--sweep`` the best of the candidate configs (``fp8_best``); with ``--silu`` gate|up runs
  its SiLU-and-multiply epilogue;
- ``scratch``: dequantize into one bf16 scratch matrix (the reference's values), then
  ``F.linear`` (what the kernel table runs for prefill sizes);
- ``scaled_mm``: per-token dynamic FP8 quantization of the activations (unfused torch ops) and
  ``torch._scaled_mm`` row-wise (W8A8: different numerics, for comparison only);
  ``scaled_mm_fast`` the same with ``use_fast_accum``.

Reports us per call and the bandwidth on the bytes each variant's weight holds (FP8: the matrix
and its float32 scales) as % of the read and copy bandwidth measured in the same run, then one
text layer's total (qkv + o + gate|up + down) per row count and variant. ``--sweep`` compiles
the candidates first in ``--jobs`` processes (Triton's disk cache) and ``--table`` writes the
faster of the best config and the scratch path per shape and row count where
``fp8_gemm.decode_config`` reads it for this GPU model (``fp8_gemm.tuned_table_path``).

    python -m benchmarks.kernels fp8 [--model 11b|90b] [--rows 1,2,4,8,16,64,128,256,1024,4096]
        [--shapes qkv,o_proj] [--sweep [--jobs 12] [--table]] [--silu] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from benchmarks.common import copy_bandwidth_gb_s, read_bandwidth_gb_s
from benchmarks.kernels.gemm import L2_BYTES, time_calls
from vllm.model_executor.layers import fp8_gemm
from vllm.model_executor.layers.fp8_gemm import Fp8Config, Fp8Weight
from vllm.model_executor.layers.quantization.fp8 import FP8_MAX, dequantize, quantize_fp8

MODELS = {  # name: {projection: (rows, K)}
    "11b": {
        "qkv": (4096 + 2 * 1024, 4096),
        "o_proj": (4096, 4096),
        "gate_up": (2 * 14336, 4096),
        "down": (4096, 14336),
    },
    "90b": {
        "qkv": (8192 + 2 * 1024, 8192),
        "o_proj": (8192, 8192),
        "gate_up": (2 * 28672, 8192),
        "down": (8192, 28672),
    },
}
VARIANTS = ("bf16", "fp8", "fp8_best", "scratch", "scaled_mm", "scaled_mm_fast")
SWEEP_MAX_ROWS = 256  # larger row counts are prefill: the scratch path and cuBLAS
SWAP_SMEM = 200 << 10  # the swapped kernel's pipeline buffers (4 stages) within shared memory


def make_weight(n: int, k: int) -> Fp8Weight:
    """Per-channel FP8 of random normal weights, as quantization at load makes them."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, s = quantize_fp8(w)
    counters = fp8_gemm.make_counters(n, SWEEP_MAX_ROWS, w.device)
    return Fp8Weight(q, s.view(-1).float(), torch.bfloat16, counters)


@dataclass
class Copies:
    """One projection's weight copies in each form a variant reads."""

    fp8: list[Fp8Weight]
    bf16: list[torch.Tensor]
    scratch: torch.Tensor
    fp8_bytes: int  # one copy as stored (matrix and scales)


def make_copies(n: int, k: int) -> Copies:
    fp8_bytes = n * k + 4 * n
    count = max(1, -(-3 * L2_BYTES // fp8_bytes))
    fws = [make_weight(n, k) for _ in range(count)]
    dense = [dequantize(fw.weight, fw.scale, torch.bfloat16, torch.bfloat16) for fw in fws]
    scratch = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    return Copies(fws, dense, scratch, fp8_bytes)


def sweep(m: int, k: int) -> list[Fp8Config]:
    """The candidate configs for ``m`` rows whose tiles divide K: CUDA-core tiles (with K
    splits) up to 8 rows, tensor-core tiles (a 16-row tile serves fewer rows with the same
    weight reads; K split up to 8 ways at 16 rows and fewer, 2 above) and the swapped
    tensor-core kernel (K split up to 8) at every row count; none for prefill sizes."""
    if m > SWEEP_MAX_ROWS:
        return []
    out = []
    if m <= fp8_gemm.MAX_CUDA_CORE_ROWS:
        bm = 1 << (m - 1).bit_length()
        out += [
            Fp8Config(bm, bn, bk, split_k=sk, num_warps=w)
            for bn, bk, sk, w in itertools.product([16, 32, 64], [64, 128], [1, 2, 4, 8], [2, 4])
            if bm * bn * bk <= 8192 * w // 4
        ]
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    splits = [1, 2, 4, 8] if m <= 16 else [1, 2]  # the small shapes have few tiles at 1 row
    out += [
        Fp8Config(bm, bn, bk, split_k=sk, num_stages=st)
        for bn, bk, sk, st in itertools.product([16, 32, 64, 128], [128, 256], splits, [3, 4])
    ]
    # The swapped tensor-core kernel at every decode size (its row tile 16 and up).
    for bm in [16 if m <= 16 else (32 if m <= 32 else 64)] + ([128] if m >= 128 else []):
        out += [
            Fp8Config(bm, bn, bk, split_k=sk, num_warps=w, num_stages=4, swap=True)
            for bn, bk, sk, w in itertools.product(
                [16, 32, 64, 128], [128, 256, 512], [1, 2, 4, 8], [4, 8]
            )
            if (w == 8) == (bn == 128) and 4 * (bn * bk + 2 * bk * bm) <= SWAP_SMEM
        ]
    return [c for c in out if c.fits(k)]


def _jobs(model: str, names: list[str], rows: list[int], silu: bool) -> list[tuple]:
    """(shape, n, k, rows, silu, config) once per compiled kernel."""
    seen, jobs = set(), []
    for name in names:
        n, k = MODELS[model][name]
        gu = silu and name == "gate_up"
        for m in rows:
            for c in sweep(m, k):
                if (name, gu, c) not in seen:  # a config compiles once whatever the rows
                    seen.add((name, gu, c))
                    jobs.append((name, n, k, m, gu, c))
    return jobs


def _compile_worker(jobs: list[tuple]) -> int:
    """Runs each (shape, rows, config) once, filling Triton's disk cache."""
    weights: dict[str, Fp8Weight] = {}
    for name, n, k, m, silu, cfg in jobs:
        if name not in weights:
            weights[name] = make_weight(n, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        try:
            (fp8_gemm.fp8_gemm_silu if silu else fp8_gemm.fp8_gemm)(x, weights[name], cfg)
        except OutOfResources:  # a config this GPU cannot launch: the timing skips it too
            continue
    torch.cuda.synchronize()
    return len(jobs)


def precompile(model: str, names: list[str], rows: list[int], silu: bool, procs: int) -> None:
    """Compiles the sweep's kernels in ``procs`` processes (Triton caches them on disk)."""
    jobs = _jobs(model, names, rows, silu)
    t0 = time.perf_counter()
    chunks = [jobs[i::procs] for i in range(procs)]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        count = sum(pool.map(_compile_worker, chunks))
    print(f"compiled {count} sweep kernels in {time.perf_counter() - t0:.0f} s", flush=True)


def _scaled_mm(fast: bool) -> Callable[[torch.Tensor, Fp8Weight], torch.Tensor]:
    def run(x: torch.Tensor, fw: Fp8Weight) -> torch.Tensor:
        scale_a = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x.float() / scale_a).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(
            xq,
            fw.weight.t(),
            scale_a=scale_a,
            scale_b=fw.scale.view(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )

    return run


def bench_row(x: torch.Tensor, c: Copies, silu: bool, do_sweep: bool, bw: dict) -> dict:
    """Every variant for one [M, K] input."""
    m, k = x.shape
    n = c.bf16[0].shape[0]

    def entry(us: float, moved: int = c.fp8_bytes) -> dict:
        gb_s = moved / us / 1e3
        return {
            "us": round(us, 2),
            "pct_read": round(100 * gb_s / bw["read_gb_s"], 1),
            "pct_copy": round(100 * gb_s / bw["copy_gb_s"], 1),
        }

    row: dict = {"m": m, "n": n, "k": k, "fp8_bytes": c.fp8_bytes}
    row["bf16"] = entry(time_calls(lambda w: F.linear(x, w), c.bf16), n * k * 2)
    run = fp8_gemm.fp8_gemm_silu if silu else fp8_gemm.fp8_gemm
    out_n = n // 2 if silu else n
    row["scratch"] = entry(
        time_calls(lambda fw: F.linear(x, fp8_gemm.dequantize(fw, c.scratch)), c.fp8)
    )
    cfg = fp8_gemm.decode_config(m, out_n, k, silu, torch.cuda.get_device_name())
    if cfg is not None:
        row["fp8"] = {**entry(time_calls(lambda fw: run(x, fw, cfg), c.fp8)), "config": str(cfg)}
    candidates = sweep(m, k) if do_sweep else []
    if candidates:
        timed = []
        for cand in candidates:
            try:
                timed.append((time_calls(lambda fw, s=cand: run(x, fw, s), c.fp8), cand))
            except OutOfResources:  # more shared memory than this GPU has
                continue
        us, best = min(timed, key=lambda t: t[0])
        row["fp8_best"] = {**entry(us), "config": str(best), "swept": len(timed)}
        # The table keeps the faster of the GEMM's best and the scratch path.
        row["choice"] = vars(best) if us < row["scratch"]["us"] else "scratch"
        row["table_key"] = fp8_gemm.table_key(out_n, k, silu)
    for name, fast in (("scaled_mm", False), ("scaled_mm_fast", True)):
        mm = _scaled_mm(fast)
        row[name] = entry(time_calls(lambda fw, mm=mm: mm(x, fw), c.fp8))
    return row


def layer_totals(log: list[dict]) -> list[dict]:
    """One text layer (every projection of the run) per row count and variant, in us."""
    out = []
    for m in sorted({r["m"] for r in log}):
        rows = [r for r in log if r["m"] == m]
        total = {
            v: round(sum(r[v]["us"] for r in rows), 1)
            for v in VARIANTS
            if all(v in r for r in rows)
        }
        out.append({"layer": [r["shape"] for r in rows], "m": m, **total})
    return out


def write_table(log: list[dict], gpu: str) -> str:
    """Merges the sweep's winners into this GPU model's tuned table; returns its path."""
    entries = [(r["table_key"], r["m"], r["choice"]) for r in log if "choice" in r]
    return str(fp8_gemm.TUNED.merge(gpu, entries))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="11b")
    ap.add_argument("--rows", default="1,2,4,8,16,64,128,256,1024,4096")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--sweep", action="store_true", help="also the best of a config sweep")
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling the sweep")
    ap.add_argument("--table", action="store_true", help="write the sweep's winners")
    ap.add_argument("--silu", action="store_true", help="gate_up with the SiLU epilogue")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the FP8 benchmark needs a CUDA device")
    names = [s for s in args.shapes.split(",") if s]
    rows = [int(r) for r in args.rows.split(",")]
    if args.sweep and args.jobs > 1:
        precompile(args.model, names, rows, args.silu, args.jobs)
    gpu = torch.cuda.get_device_name()
    bw = {"copy_gb_s": copy_bandwidth_gb_s(), "read_gb_s": read_bandwidth_gb_s()}
    print(f"{gpu}: copy {bw['copy_gb_s']:.0f} GB/s, read {bw['read_gb_s']:.0f} GB/s; {args.model}")
    log: list[dict] = []
    for name in names:
        n, k = MODELS[args.model][name]
        copies = make_copies(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            silu = args.silu and name == "gate_up"
            row = {"model": args.model, "shape": name, **bench_row(x, copies, silu, args.sweep, bw)}
            log.append(row)
            print(json.dumps(row), flush=True)
        del copies
        torch.cuda.empty_cache()
    totals = layer_totals(log)
    for t in totals:
        print(json.dumps(t), flush=True)
    if args.table:
        print("tuned configs written to", write_table(log, gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, **bw, "fp8": log, "layer": totals}, f, indent=1)


if __name__ == "__main__":
    main()
