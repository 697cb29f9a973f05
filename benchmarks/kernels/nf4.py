"""The 4-bit linears of one 11B text layer: the Triton NF4 GEMM against bf16 and bitsandbytes.

For each projection a decode step runs (fused QKV, O, fused gate|up, down) and each row count,
times as CUDA-graph replays cycling over enough weight copies that every read comes from HBM
(``gemm.time_calls``): bf16 ``F.linear`` (cuBLAS), the 4-bit GEMM that dequantizes in registers
(``nf4_gemm``, the config the kernel table would choose, or the best of ``--sweep``), the
prefill path (dequantize into the scratch matrix, then ``F.linear``) and, where bitsandbytes is
importable, its ``matmul_4bit`` on the same bytes. Reports us per call and the read bandwidth on
the bytes as the checkpoint stores them (packed weight, uint8 block scales, second-level scales).

    python -m benchmarks.kernels nf4 [--rows 1,4,16,64,128,256] [--shapes qkv,o_proj]
        [--sweep] [--silu] [--json PATH]
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
from vllm.model_executor.layers import nf4_gemm
from vllm.model_executor.layers.linear import Linear, MergedLinear
from vllm.model_executor.layers.nf4_gemm import Nf4Config, QuantizedWeight
from vllm.model_executor.layers.quantization.bitsandbytes import Bnb4bitFormat, Bnb4bitSpec

SHAPES = {  # name: (shard rows, K)
    "qkv": ((4096, 1024, 1024), 4096),
    "o_proj": ((4096,), 4096),
    "gate_up": ((14336, 14336), 4096),
    "down": ((4096,), 14336),
}


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


def sweep(m: int) -> list[Nf4Config]:
    block_ms = [16] if m <= 16 else ([32] if m <= 32 else [64, 128])
    return [
        Nf4Config(bm, bn, bk, num_warps=w, num_stages=st)
        for bm, bn, bk, w, st in itertools.product(
            block_ms, [32, 64, 128], [64, 128, 256], [4, 8], [2, 3, 4]
        )
    ]


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


def bench_row(x: torch.Tensor, c: Copies, silu: bool, do_sweep: bool, copy_gb_s: float) -> dict:
    """Every variant for one [M, K] input."""
    m, k = x.shape
    n = c.bf16[0].shape[0]

    def entry(us: float, moved: int = c.nbytes) -> dict:
        return {"us": round(us, 2), "pct_copy": round(100 * moved / us / 1e3 / copy_gb_s, 1)}

    row: dict = {"m": m, "n": n, "k": k, "stored_bytes": c.nbytes}
    row["bf16"] = entry(time_calls(lambda w: F.linear(x, w), c.bf16), n * k * 2)
    run = nf4_gemm.nf4_gemm_silu if silu else nf4_gemm.nf4_gemm
    cfg = nf4_gemm.default_config(m, n // 2 if silu else n, k)
    row["nf4"] = {**entry(time_calls(lambda q: run(x, q, cfg), c.qws)), "config": str(cfg)}
    if do_sweep:
        timed = [
            (time_calls(lambda q, s=s: run(x, q, s), c.qws), s)
            for s in sweep(m)
            if k % s.block_k == 0
        ]
        us, best = min(timed, key=lambda t: t[0])
        row["nf4_best"] = {**entry(us), "config": str(best)}
    row["scratch"] = entry(
        time_calls(lambda q: F.linear(x, nf4_gemm.dequantize(q, c.scratch)), c.qws)
    )
    if c.bnb is not None:
        index = {id(q): i for i, q in enumerate(c.qws)}
        bnb = c.bnb
        row["bnb_matmul_4bit"] = entry(time_calls(lambda q: bnb(x, index[id(q)]), c.qws))
    return row


def bench_shape(
    name: str, rows: list[int], copy_gb_s: float, args: argparse.Namespace, log: list[dict]
) -> None:
    shards, k = SHAPES[name]
    copies = make_copies(shards, k, args.bnb)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {
            "shape": name,
            **bench_row(x, copies, args.silu and name == "gate_up", args.sweep, copy_gb_s),
        }
        log.append(row)
        print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also the best of a config sweep")
    ap.add_argument("--silu", action="store_true", help="gate_up with the SiLU epilogue")
    ap.add_argument(
        "--no-bnb", dest="bnb", action="store_false", help="skip bitsandbytes' matmul_4bit"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the NF4 benchmark needs a CUDA device")
    copy_gb_s = copy_bandwidth_gb_s()
    print(f"copy bandwidth {copy_gb_s:.0f} GB/s; {torch.cuda.get_device_name()}")
    log: list[dict] = []
    for name in filter(None, args.shapes.split(",")):
        bench_shape(name, [int(r) for r in args.rows.split(",")], copy_gb_s, args, log)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "copy_gb_s": copy_gb_s, "nf4": log},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
