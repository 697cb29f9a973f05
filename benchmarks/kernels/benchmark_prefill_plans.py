"""Prefill SDPA: first-call cost of a new prompt length, unbucketed vs bucketed
(``vllm/attention/ops/sdpa_prefill.py``), the warm-up that builds every bucket's plan, and the
steady-state cost of the padding.

Inputs are laid out as the model hands them over (q/k/v: views of one fused projection; vision
K/V of whole 4-tile images); the kernels each variant launches (which SDPA back-end torch
picked for that layout) are listed on CUDA. Times are host wall-clock around one synchronised
call (first calls) and ``triton.testing.do_bench`` medians (steady state).

Usage: ``python benchmarks/kernels/benchmark_prefill_plans.py [--out FILE.json]`` (``--smoke``:
tiny heads and lengths, CPU-friendly).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from vllm.attention.ops import reference as ref
from vllm.attention.ops import sdpa_prefill


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _median_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = sorted(_wall_ms(fn, device) for _ in range(5))
    return times[len(times) // 2]


def _kernels(fn: Callable[[], object], device: torch.device) -> list[str]:
    """Names of the device kernels one call launches (which SDPA back-end ran)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages() if e.device_type.name == "CUDA"}
    except Exception as e:  # a diagnostic: never lose the timings above to it
        return [f"profiler failed: {e!r}"[:200]]
    return sorted(n[:80] for n in names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU smoke test)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        hq, hkv, d, vis_len, max_len = 4, 2, 16, 40, 300
        new_lengths, steady = [101, 102, 133], [29, 240]
    else:
        hq, hkv, d, vis_len, max_len = 32, 8, 128, 6404, 4096
        new_lengths, steady = [201, 202, 233, 301, 333, 517, 1111], [129, 239, 400, 1024,
                                                                     2100, 4000]

    gen = torch.Generator(device=device).manual_seed(0)
    top = max(new_lengths + steady)
    qkv = torch.randn(top, (hq + 2 * hkv) * d, generator=gen, device=device, dtype=dtype)
    q_all, k_all, v_all = (t.view(top, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], 1))
    vis = torch.randn(vis_len, 2 * hkv * d, generator=gen, device=device, dtype=dtype)
    vk, vv = (t.view(vis_len, hkv, d) for t in vis.split([hkv * d, hkv * d], 1))
    scale = d**-0.5

    def causal(fn, n):
        return lambda: fn(q_all[:n], k_all[:n], v_all[:n], [n], scale)

    def cross(fn, n):
        return lambda: fn(q_all[:n].contiguous(), vk, vv, [(0, n, 0, vis_len)], scale)

    results: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                     "torch": torch.__version__}
    t0 = time.perf_counter()
    calls = sdpa_prefill.warm_up_plans(max_len, hq, hkv, d, dtype, device, [vis_len])
    _sync(device)
    results["warm_up"] = {"max_len": max_len, "calls": calls,
                          "seconds": time.perf_counter() - t0}
    first = {}
    for kind, make in (("causal", causal), ("cross", cross)):
        for name, fn in (("unbucketed", ref.varlen_causal_attention
                          if kind == "causal" else ref.ranged_cross_attention),
                         ("bucketed", sdpa_prefill.causal_attention if kind == "causal"
                          else sdpa_prefill.ranged_cross_attention)):
            first[f"{kind}_{name}"] = [round(_wall_ms(make(fn, n), device), 3)
                                       for n in new_lengths]
    results["first_call_ms"] = {"lengths": new_lengths, **first}
    steady_ms = {}
    for n in steady:
        for kind, make in (("causal", causal), ("cross", cross)):
            base = ref.varlen_causal_attention if kind == "causal" else ref.ranged_cross_attention
            new = (sdpa_prefill.causal_attention if kind == "causal"
                   else sdpa_prefill.ranged_cross_attention)
            steady_ms[f"{kind}_{n}"] = {"unbucketed": _median_ms(make(base, n), device),
                                        "bucketed": _median_ms(make(new, n), device),
                                        "bucket": sdpa_prefill.bucket_len(n)}
    results["steady_ms"] = steady_ms
    n = steady[0]
    results["kernels"] = {
        "causal_engine_layout": _kernels(causal(ref.varlen_causal_attention, n), device),
        "causal_contiguous": _kernels(lambda: ref.varlen_causal_attention(
            q_all[:n].contiguous(), k_all[:n].contiguous(), v_all[:n].contiguous(), [n],
            scale), device),
        "causal_bucketed": _kernels(causal(sdpa_prefill.causal_attention, n), device),
        "cross_unbucketed": _kernels(cross(ref.ranged_cross_attention, n), device),
        "cross_bucketed": _kernels(cross(sdpa_prefill.ranged_cross_attention, n), device)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    w = results["warm_up"]
    print(f"warm-up: {w['calls']} calls up to {w['max_len']} tokens in {w['seconds']:.2f} s")
    print("first call of a new length (ms):", ", ".join(map(str, new_lengths)))
    for key, values in first.items():
        print(f"  {key:18s}", " ".join(f"{x:8.2f}" for x in values))
    print("steady state (ms): unbucketed / bucketed (bucket)")
    for key, r in steady_ms.items():
        print(f"  {key:12s} {r['unbucketed']:.4f} / {r['bucketed']:.4f} ({r['bucket']})")
    for key, names in results["kernels"].items():
        print(f"  kernels {key}: {' | '.join(names)}")


if __name__ == "__main__":
    main()
