"""Paged self decode at batch 64 (512 and 4,096 tokens) for a hardware-counter profiler (CUDA).

Runs the decode once per (config, shape) between cudaProfilerStart/Stop, so a profiler started
with ``--profile-from-start off`` sees exactly those kernels; prints each compiled kernel's
registers, spills and shared memory, and with ``TIME=1`` the graph-replay time of each case.
Extra configs: ``name=field:value,field:value`` (DecodeConfig fields).

    ncu --clock-control none --profile-from-start off --section LaunchStats \\
        --section Occupancy --section SpeedOfLight --section WarpStateStats \\
        python benchmarks/kernels/probe_decode.py mc64=min_chunk:64
    TIME=1 python benchmarks/kernels/probe_decode.py mc64=min_chunk:64
"""

from __future__ import annotations

import math
import os
import sys

import torch
from benchmark_attention import HEAD_DIM as D
from benchmark_attention import HKV, HQ, SELF_PAGE, time_graph_us

from vllm.attention.ops import triton_decode as td


def inputs(batch: int, kv_len: int) -> tuple[torch.Tensor, ...]:
    pages = math.ceil(kv_len / SELF_PAGE)
    n = batch * pages + 1
    pool = torch.randn(n, 2, HKV, SELF_PAGE, D, dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(n - 1, device="cuda")[: batch * pages] + 1
    return (torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda"), pool[:, 0],
            pool[:, 1], perm.view(batch, pages).to(torch.int32),
            torch.full((batch,), kv_len, dtype=torch.int32, device="cuda"))


def main() -> None:
    cfgs = {"default": td.DEFAULT_DECODE_CONFIG}
    for spec in sys.argv[1:]:
        name, fields = spec.split("=")
        cfgs[name] = td.DecodeConfig(**{k: int(v) for k, v in
                                        (f.split(":") for f in fields.split(","))})
    cases = []
    for name, cfg in cfgs.items():
        for batch, kv_len in ((64, 512), (64, 4096)):
            q, kc, vc, tables, lens = inputs(batch, kv_len)

            def fn(q=q, kc=kc, vc=vc, tables=tables, lens=lens, cfg=cfg) -> None:
                td.paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, config=cfg)

            fn()
            cases.append((name, batch, kv_len, fn))
    torch.cuda.synchronize()
    for kernel in (td._decode_segment_kernel, td._decode_combine_kernel):
        for cache in kernel.device_caches.values():
            for compiled in (cache[0] if isinstance(cache, tuple) else cache).values():
                compiled._init_handles()
                print(f"{kernel.fn.__name__}: regs {compiled.n_regs} spills {compiled.n_spills} "
                      f"shared {compiled.metadata.shared} warps {compiled.metadata.num_warps} "
                      f"stages {compiled.metadata.num_stages}")
    torch.cuda.cudart().cudaProfilerStart()
    for _, _, _, fn in cases:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled, in order:", [(n, b, L) for n, b, L, _ in cases])
    if os.environ.get("TIME"):
        for name, batch, kv_len, fn in cases:
            print(f"{name:10s} {batch}x{kv_len}: {time_graph_us([fn] * 16):.1f} us")


if __name__ == "__main__":
    main()
