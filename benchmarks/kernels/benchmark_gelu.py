"""The vision MLP's activation: torch's exact GELU against the in-place Triton kernel (CUDA).

Shape: one 4-tile image's vision tokens (6,432 padded rows) x the 11B vision MLP width (5,120),
bf16. Prints the median time of each, the bandwidth counting one read and one write, and how
many elements differ from torch.

    python benchmarks/kernels/benchmark_gelu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from vllm.model_executor.layers.fused_kernels import gelu_


def main() -> None:
    x = torch.randn(6432, 5120, dtype=torch.bfloat16, device="cuda") * 3
    work = x.clone()
    nbytes = 2 * x.nbytes
    rows = {
        "torch F.gelu": lambda: F.gelu(x),
        "triton gelu_ (in place)": lambda: gelu_(work),
    }
    for name, fn in rows.items():
        ms = triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")
        print(f"{name:26s} {ms * 1e3:7.1f} us  {nbytes / (ms * 1e-3) / 1e12:5.2f} TB/s")
    ref, out = F.gelu(x), gelu_(x.clone())
    diff = (ref != out).sum().item()
    print(f"elements differing from torch: {diff} of {x.numel()}; "
          f"max abs diff {(ref.float() - out.float()).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
