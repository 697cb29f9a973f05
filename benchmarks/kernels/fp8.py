"""The FP8 linears of one text layer: the Triton weight-only FP8 GEMM against bf16, the
dequantized scratch + cuBLAS, and torch._scaled_mm with per-token activation quantization.

For each projection a decode step runs (fused QKV, O, fused gate|up, down) and each row count,
times as CUDA-graph replays cycling over enough weight copies that every read comes from HBM
(``gemm.time_calls``):

- ``bf16``: ``F.linear`` on the bf16 weight (cuBLAS);
- ``fp8``: the Triton GEMM that converts the FP8 tile in registers and applies the channel
  scale in its epilogue (``fp8_gemm``; the config the kernel table would choose, or the best
  of ``--sweep``; with ``--silu`` gate|up runs its SiLU-and-multiply epilogue);
- ``scratch``: dequantize into one bf16 scratch matrix (the reference's values), then
  ``F.linear`` (what the kernel table runs for prefill sizes);
- ``scaled_mm``: per-token dynamic FP8 quantization of the activations (unfused torch ops) and
  ``torch._scaled_mm`` row-wise (W8A8: different numerics, for comparison only);
  ``scaled_mm_fast`` the same with ``use_fast_accum``.

Reports us per call and the read bandwidth on the bytes each variant's weight holds (FP8: the
matrix and its float32 scales), then one text layer's total (qkv + o + gate|up + down) per row
count and variant. ``--model 90b`` takes the 90B shapes.

    python -m benchmarks.kernels fp8 [--rows 1,4,16,64,128,256,1024,4096] [--model 11b|90b]
        [--shapes qkv,o_proj] [--sweep] [--silu] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.common import copy_bandwidth_gb_s
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
    fws, dense = [], []
    for _ in range(count):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_fp8(w)
        fw = Fp8Weight(q, s.view(-1).float(), torch.bfloat16)
        fws.append(fw)
        dense.append(dequantize(fw.weight, fw.scale, torch.bfloat16, torch.bfloat16))
        del w
    scratch = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    return Copies(fws, dense, scratch, fp8_bytes)


def sweep(m: int) -> list[Fp8Config]:
    """Launch shapes to try for ``m`` rows: CUDA-core tiles (with K splits) up to 8 rows,
    tensor-core tiles from 16 (and for 8 too)."""
    out = []
    if m <= fp8_gemm.MAX_CUDA_CORE_ROWS:
        bm = 1 << (m - 1).bit_length()
        out += [
            Fp8Config(bm, bn, bk, split_k=sk, num_warps=w, num_stages=st)
            for bn, bk, sk, w, st in itertools.product(
                [16, 32, 64], [32, 64, 128], [1, 2, 4, 8], [2, 4], [2, 3]
            )
            if bm * bn * bk <= 16384
        ]
    if m >= 8:
        block_ms = [16] if m <= 16 else ([32] if m <= 32 else [64, 128])
        out += [
            Fp8Config(bm, bn, bk, split_k=sk, num_warps=w, num_stages=st)
            for bm, bn, bk, sk, w, st in itertools.product(
                block_ms, [16, 32, 64, 128], [64, 128, 256], [1, 2], [4, 8], [2, 3, 4]
            )
        ]
    return out


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


def bench_row(x: torch.Tensor, c: Copies, silu: bool, do_sweep: bool, copy_gb_s: float) -> dict:
    """Every variant for one [M, K] input."""
    m, k = x.shape
    n = c.bf16[0].shape[0]

    def entry(us: float, moved: int = c.fp8_bytes) -> dict:
        return {"us": round(us, 2), "pct_copy": round(100 * moved / us / 1e3 / copy_gb_s, 1)}

    row: dict = {"m": m, "n": n, "k": k, "fp8_bytes": c.fp8_bytes}
    row["bf16"] = entry(time_calls(lambda w: F.linear(x, w), c.bf16), n * k * 2)
    run = fp8_gemm.fp8_gemm_silu if silu else fp8_gemm.fp8_gemm
    cfg = fp8_gemm.default_config(m, n // 2 if silu else n, k)
    row["fp8"] = {**entry(time_calls(lambda fw: run(x, fw, cfg), c.fp8)), "config": str(cfg)}
    if do_sweep:
        timed = [
            (time_calls(lambda fw, s=s: run(x, fw, s), c.fp8), s) for s in sweep(m) if s.fits(k)
        ]
        us, best = min(timed, key=lambda t: t[0])
        row["fp8_best"] = {**entry(us), "config": str(best)}
    row["scratch"] = entry(
        time_calls(lambda fw: F.linear(x, fp8_gemm.dequantize(fw, c.scratch)), c.fp8)
    )
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


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,128,256,1024,4096")
    ap.add_argument("--model", choices=tuple(MODELS), default="11b")
    ap.add_argument("--shapes", default=None, help="projections (default: all four)")
    ap.add_argument("--sweep", action="store_true", help="also the best of a config sweep")
    ap.add_argument("--silu", action="store_true", help="gate_up with the SiLU epilogue")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the FP8 benchmark needs a CUDA device")
    shapes = MODELS[args.model]
    names = [s for s in (args.shapes or ",".join(shapes)).split(",") if s]
    copy_gb_s = copy_bandwidth_gb_s()
    print(f"copy bandwidth {copy_gb_s:.0f} GB/s; {torch.cuda.get_device_name()}; {args.model}")
    log: list[dict] = []
    for name in names:
        n, k = shapes[name]
        copies = make_copies(n, k)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            silu = args.silu and name == "gate_up"
            row = {"shape": name, **bench_row(x, copies, silu, args.sweep, copy_gb_s)}
            log.append(row)
            print(json.dumps(row), flush=True)
        del copies
        torch.cuda.empty_cache()
    totals = layer_totals(log)
    for t in totals:
        print(json.dumps(t), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "copy_gb_s": copy_gb_s,
                    "model": args.model,
                    "fp8": log,
                    "layer": totals,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
