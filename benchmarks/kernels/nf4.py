"""The 4-bit linears of one 11B text layer: the Triton NF4 GEMM against bf16 and bitsandbytes.

For each projection a decode step runs (fused QKV, O, fused gate|up, down) and each row count,
times as CUDA-graph replays cycling over enough weight copies that every read comes from HBM
(``gemm.time_calls``): bf16 ``F.linear`` (cuBLAS), the 4-bit GEMM that dequantizes in registers
(``nf4_gemm``, the config the kernel table would choose, or the best of ``--sweep``), the
prefill path (dequantize into the scratch matrix, then ``F.linear``) and, where bitsandbytes is
importable, its ``matmul_4bit`` on the same bytes. Reports us per call and the read bandwidth on
the bytes as the checkpoint stores them (packed weight, uint8 block scales, second-level scales).

``--sweep`` times every candidate config (compiled first by ``--jobs`` processes sharing
Triton's disk cache) and ``--table`` writes the best per shape and row count where
``nf4_gemm.default_config`` reads it for this GPU model (``nf4_gemm.tuned_table_path``).

    python -m benchmarks.kernels nf4 [--model 11b|90b] [--rows 1,4,16,64,128,256]
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
from vllm.model_executor.layers import nf4_gemm
from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.model_executor.layers.nf4_gemm import Nf4Config, QuantizedWeight
from vllm.model_executor.layers.quantization.bitsandbytes import Bnb4bitFormat, Bnb4bitSpec

MODELS = {  # name: {projection: (shard rows, K)}
    "11b": {
        "qkv": ((4096, 1024, 1024), 4096),
        "o_proj": ((4096,), 4096),
        "gate_up": ((14336, 14336), 4096),
        "down": ((4096,), 14336),
    },
    "90b": {
        "qkv": ((8192, 1024, 1024), 8192),
        "o_proj": ((8192,), 8192),
        "gate_up": ((28672, 28672), 8192),
        "down": ((8192,), 28672),
    },
}
SHAPES = MODELS["11b"]


def make_layer(shards: tuple[int, ...], k: int) -> Linear:
    """A 4-bit layer (NF4, blocksize 64, double quantization) of random normal weights."""
    fmt = Bnb4bitFormat(Bnb4bitSpec(), quantize_on_load=True, dtype=torch.bfloat16)
    with torch.device("cuda"):
        if len(shards) == 1:
            layer = Linear(k, shards[0], fmt=fmt)
        else:
            names = ["q", "k", "v"] if len(shards) == 3 else ["gate", "up"]
            layer = MergedLinear(k, list(shards), names, fmt=fmt)
    spans = list(layer.shards) or [None]
    for shard, rows in zip(spans, shards, strict=True):
        w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
        layer.weight.weight_loader(layer.weight, w, shard)  # type: ignore[attr-defined]
    return layer


def stored_bytes(layer: Linear) -> int:
    return sum(t.numel() * t.element_size() for t in layer.state_dict().values())


SWEEP_MAX_ROWS = 256  # larger row counts are prefill: the scratch path and cuBLAS


def sweep(m: int, k: int, blocksize: int = 64) -> list[Nf4Config]:
    """The candidate configs for ``m`` rows (those whose loop divides K): the CUDA-core pair
    kernel up to 4 rows, the mma kernel up to 64 (blocks of 64), the tensor-core table kernel
    at every decode size (a narrower grid where the pair kernel runs too); none for prefill
    sizes."""
    if m > SWEEP_MAX_ROWS:
        return []
    cands = []
    if m <= 4:
        bm = 1 << (m - 1).bit_length()
        grid = itertools.product([(256, 4), (512, 8)], [1, 2], [1, 2, 4, 8, 16])
        cands += [Nf4Config(bm, bn, it, sp, num_warps=w, pairs=True) for (bn, w), it, sp in grid]
    if m <= 64 and blocksize == 64:  # 8 x rows a program up to 8, 16 above
        grid = itertools.product([2, 4, 8], [1, 2, 4, 8, 16])
        bm = 8 if m <= 8 else 16
        cands += [Nf4Config(bm, 16 * w, 4, sp, num_warps=w, mma=True) for w, sp in grid]
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    table_grid = itertools.product(
        [64] if m <= 4 else [32, 64, 128],
        [1, 2] if m <= 4 else [1, 2, 4],
        [2, 4, 8] if m <= 4 else [1, 2, 4, 8],
    )
    cands += [
        Nf4Config(bm, bn, it, sp, num_warps=8 if bn == 128 else 4, table=True)
        for bn, it, sp in table_grid
        if bm * bn <= 4096
    ]
    if m > 64:  # 128-row tiles: each weight tile looked up once for up to 128 rows
        cands += [
            Nf4Config(128, bn, it, sp, num_warps=bn // 8, table=True)
            for bn, it, sp in itertools.product([32, 64], [1, 2], [1, 2, 4, 8])
        ]
    return [c for c in cands if c.fits(k, blocksize)]


def _jobs(model: str, names: list[str], rows: list[int], silu: bool) -> list[tuple]:
    out = []
    for name in names:
        shards, k = MODELS[model][name]
        for m in rows:
            out += [(name, shards, k, m, silu and name == "gate_up", c) for c in sweep(m, k)]
    # A config compiles once whatever the row count (within the same block_m).
    seen, unique = set(), []
    for job in out:
        key = (job[0], job[4], job[5])
        if key not in seen:
            seen.add(key)
            unique.append(job)
    return unique


def _compile_worker(jobs: list[tuple]) -> int:
    """Runs each (shape, rows, config) once, filling Triton's disk cache."""
    weights: dict[str, QuantizedWeight] = {}
    done = 0
    for name, shards, k, m, silu, cfg in jobs:
        if name not in weights:
            layer = make_layer(shards, k)
            weights[name] = layer.fmt.quantized_weight(layer)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        try:
            (nf4_gemm.nf4_gemm_silu if silu else nf4_gemm.nf4_gemm)(x, weights[name], cfg)
        except OutOfResources:  # a config this GPU cannot launch: the timing skips it too
            continue
        done += 1
    torch.cuda.synchronize()
    return done


def precompile(model: str, names: list[str], rows: list[int], silu: bool, procs: int) -> None:
    """Compiles the sweep's kernels in ``procs`` processes (Triton caches them on disk)."""
    jobs = _jobs(model, names, rows, silu)
    t0 = time.perf_counter()
    # One (shape, config) compiles once: the row count matters only through the config.
    chunks = [jobs[i::procs] for i in range(procs)]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        count = sum(pool.map(_compile_worker, chunks))
    print(f"compiled {count} sweep kernels in {time.perf_counter() - t0:.0f} s", flush=True)


def _bnb_matmul(layers: list[Linear]) -> Callable[[torch.Tensor, int], object] | None:
    """bitsandbytes' matmul_4bit on each copy's dequantized-then-requantized weight (the same
    NF4 format; one matrix per layer), or None without bitsandbytes."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
    except ImportError:
        return None
    states = []
    for layer in layers:
        w = layer.fmt.dequantize(layer, torch.bfloat16)
        states.append(
            bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        )
    return lambda x, i: bnb.matmul_4bit(x, states[i][0].t(), quant_state=states[i][1])


@dataclass
class Copies:
    """One projection's weight copies in each form a variant reads."""

    qws: list[QuantizedWeight]
    bf16: list[torch.Tensor]
    scratch: torch.Tensor
    nbytes: int  # one copy as stored
    bnb: Callable[[torch.Tensor, int], object] | None


def make_copies(shards: tuple[int, ...], k: int, with_bnb: bool) -> Copies:
    first = make_layer(shards, k)
    count = max(1, -(-3 * L2_BYTES // stored_bytes(first)))
    layers = [first] + [make_layer(shards, k) for _ in range(count - 1)]
    n = sum(shards)
    return Copies(
        [layer.fmt.quantized_weight(layer) for layer in layers],
        [layer.fmt.dequantize(layer, torch.bfloat16) for layer in layers],
        torch.empty(n, k, device="cuda", dtype=torch.bfloat16),
        stored_bytes(first),
        _bnb_matmul(layers) if with_bnb else None,
    )


def bench_row(x: torch.Tensor, c: Copies, silu: bool, do_sweep: bool, bw: dict) -> dict:
    """Every variant for one [M, K] input (``bw``: copy and read GB/s)."""
    m, k = x.shape
    n = c.bf16[0].shape[0]

    def entry(us: float, moved: int = c.nbytes) -> dict:
        gb_s = moved / us / 1e3
        return {
            "us": round(us, 2),
            "pct_read": round(100 * gb_s / bw["read_gb_s"], 1),
            "pct_copy": round(100 * gb_s / bw["copy_gb_s"], 1),
        }

    row: dict = {"m": m, "n": n, "k": k, "stored_bytes": c.nbytes}
    row["bf16"] = entry(time_calls(lambda w: F.linear(x, w), c.bf16), n * k * 2)
    run = nf4_gemm.nf4_gemm_silu if silu else nf4_gemm.nf4_gemm
    out_n = n // 2 if silu else n
    gpu = torch.cuda.get_device_name()
    row["scratch"] = entry(
        time_calls(lambda q: F.linear(x, nf4_gemm.dequantize(q, c.scratch)), c.qws)
    )
    cfg = nf4_gemm.decode_config(m, out_n, k, silu=silu, device_name=gpu)
    if cfg is not None:
        row["nf4"] = {**entry(time_calls(lambda q: run(x, q, cfg), c.qws)), "config": str(cfg)}
    candidates = sweep(m, k) if do_sweep else []
    if candidates:
        timed = []
        for cand in candidates:
            try:
                timed.append((time_calls(lambda q, s=cand: run(x, q, s), c.qws), cand))
            except OutOfResources:  # more shared memory than this GPU has
                continue
        us, best = min(timed, key=lambda t: t[0])
        row["nf4_best"] = {**entry(us), "config": str(best), "swept": len(timed)}
        kinds = {  # each kernel's own best, for the record
            "pairs": lambda c: c.pairs,
            "table": lambda c: c.table,
            "mma": lambda c: c.mma,
        }
        for kind, of_kind in kinds.items():
            mine = [t for t in timed if of_kind(t[1])]
            if mine:
                kus, kcfg = min(mine, key=lambda t: t[0])
                row[f"nf4_best_{kind}"] = {**entry(kus), "config": str(kcfg)}
        # The table keeps the faster of the GEMM's best and the scratch path.
        row["choice"] = vars(best) if us < row["scratch"]["us"] else "scratch"
        row["table_key"] = nf4_gemm.table_key(out_n, k, 64, silu)
    if c.bnb is not None:
        index = {id(q): i for i, q in enumerate(c.qws)}
        bnb = c.bnb
        row["bnb_matmul_4bit"] = entry(time_calls(lambda q: bnb(x, index[id(q)]), c.qws))
    return row


def bench_shape(
    name: str, rows: list[int], bw: dict, args: argparse.Namespace, log: list[dict]
) -> None:
    shards, k = MODELS[args.model][name]
    copies = make_copies(shards, k, args.bnb)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        silu = args.silu and name == "gate_up"
        row = {"model": args.model, "shape": name, **bench_row(x, copies, silu, args.sweep, bw)}
        log.append(row)
        print(json.dumps(row), flush=True)
    del copies
    torch.cuda.empty_cache()


def write_table(log: list[dict], gpu: str) -> str:
    """Merges the sweep's winners into this GPU model's tuned table; returns its path."""
    entries = [(r["table_key"], r["m"], r["choice"]) for r in log if "choice" in r]
    return str(nf4_gemm.TUNED.merge(gpu, entries))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="11b")
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--sweep", action="store_true", help="also the best of a config sweep")
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling the sweep")
    ap.add_argument("--table", action="store_true", help="write the sweep's winners")
    ap.add_argument("--silu", action="store_true", help="gate_up with the SiLU epilogue")
    ap.add_argument(
        "--no-bnb", dest="bnb", action="store_false", help="skip bitsandbytes' matmul_4bit"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the NF4 benchmark needs a CUDA device")
    names = [s for s in args.shapes.split(",") if s]
    rows = [int(r) for r in args.rows.split(",")]
    if args.sweep and args.jobs > 1:
        precompile(args.model, names, rows, args.silu, args.jobs)
    gpu = torch.cuda.get_device_name()
    bw = {"copy_gb_s": copy_bandwidth_gb_s(), "read_gb_s": read_bandwidth_gb_s()}
    print(f"{gpu}: copy {bw['copy_gb_s']:.0f} GB/s, read {bw['read_gb_s']:.0f} GB/s")
    log: list[dict] = []
    for name in names:
        bench_shape(name, rows, bw, args, log)
    if args.table:
        print("tuned configs written to", write_table(log, gpu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, **bw, "nf4": log}, f, indent=1)


if __name__ == "__main__":
    main()
