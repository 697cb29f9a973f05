"""Dependent launch on a chain of decode kernels: the 11B text layer's FP8 linears with its two
norms, ``--layers`` layers (distinct weights, more than L2 holds) captured in one CUDA graph and
replayed, with dependent launch off and in each variant (``pdl.py``: where a GEMM lets the next
kernel start, and how many bytes of each weight row a GEMM program prefetches into L2 first).

Per layer: RMSNorm, fused q|k|v, O (on q's columns), the residual add and RMSNorm, gate|up with
the SiLU epilogue, down; each GEMM with the config the kernel table takes for that row count.
Reports us per layer and the weight bytes' share of read bandwidth measured in the same run.

    python -m benchmarks.kernels pdl [--rows 1,16] [--layers 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.common import read_bandwidth_gb_s
from benchmarks.kernels.fp8 import MODELS, make_weight
from vllm.model_executor.layers import fp8_gemm, pdl
from vllm.model_executor.layers.fused_kernels import rms_norm

# name: (dependent launch on, GEMM trigger, prefetch limit in bytes)
VARIANTS = {
    "off": (False, 1, 0),
    "start, no prefetch": (True, 1, 0),
    "start, prefetch 1 KiB": (True, 1, 1024),
    "late, no prefetch": (True, 2, 0),
    "late, prefetch 1 KiB": (True, 2, 1024),
    "late, prefetch 4 KiB": (True, 2, 4096),
}


def _layer_weights(count: int) -> list[dict]:
    shapes = MODELS["11b"]
    return [{name: make_weight(*shapes[name]) for name in shapes} for _ in range(count)]


def _chain(x: torch.Tensor, layers: list[dict], norm_w: torch.Tensor, cfgs: dict) -> torch.Tensor:
    residual = x.clone()
    h = x
    for w in layers:
        n = rms_norm(h, norm_w, 1e-5)
        qkv = fp8_gemm.fp8_gemm(n, w["qkv"], cfgs["qkv"])
        o = fp8_gemm.fp8_gemm(qkv[:, : x.shape[1]], w["o_proj"], cfgs["o_proj"])
        n2 = rms_norm(o, norm_w, 1e-5, residual=residual)
        g = fp8_gemm.fp8_gemm_silu(n2, w["gate_up"], cfgs["gate_up"])
        h = fp8_gemm.fp8_gemm(g, w["down"], cfgs["down"])
    return h


def time_chain(m: int, layers: list[dict], replays: int = 20) -> float:
    """us per layer of the chain at ``m`` rows, replayed from one graph."""
    hidden = MODELS["11b"]["o_proj"][0]
    gpu = torch.cuda.get_device_name()
    cfgs = {}
    for name, (n, k) in MODELS["11b"].items():
        silu = name == "gate_up"
        cfgs[name] = fp8_gemm.decode_config(m, n // 2 if silu else n, k, silu, gpu)
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    _chain(x, layers, norm_w, cfgs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _chain(x, layers, norm_w, cfgs)
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(layers))
    return statistics.median(times)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the dependent-launch benchmark needs a CUDA device")
    layers = _layer_weights(args.layers)
    layer_bytes = sum(w.weight.numel() + 4 * w.scale.numel() for w in layers[0].values())
    read = read_bandwidth_gb_s()
    print(
        f"{torch.cuda.get_device_name()}: read {read:.0f} GB/s; {layer_bytes / 1e6:.1f} MB a layer"
    )
    log = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (on, trigger, prefetch) in VARIANTS.items():
            os.environ["VLLM_PDL"] = "1" if on else "0"
            pdl.GEMM_TRIGGER, pdl.PREFETCH_LIMIT = trigger, prefetch
            us = time_chain(m, layers)
            row = {"m": m, "variant": name, "us_per_layer": round(us, 2)}
            row["pct_read"] = round(100 * layer_bytes / us / 1e3 / read, 1)
            log.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "read_gb_s": read, "log": log}, f)


if __name__ == "__main__":
    main()
