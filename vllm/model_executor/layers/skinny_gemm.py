"""Triton GEMM for decode-sized batches: y = x @ W^T with few rows, the weight streamed once.

At decode batch sizes a linear layer reads its whole weight for a handful of rows, so its cost
is the weight bytes over memory bandwidth. cuBLAS covers these shapes with split-K kernels
followed by a separate reduction kernel (two graph nodes per linear at batch 1), and at 32-64
rows picks tiles that stream the weight below copy bandwidth. This kernel gives each program
one [BLOCK_M, BLOCK_N] output tile over the whole K (no split, one launch, a fixed reduction
order for a given config), with the programs sharing a weight tile scheduled next to each other
so a weight tile read for the first block of rows is served from L2 for the next.

The config depends on (M bucket, N, K) only, so eager and graph replay at the same bucket run the
same kernel (DESIGN.md's equality contract).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Row blocks vary fastest: the programs reading one weight tile run back to back.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols[:, None] * w_stride + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of BLOCK_K (checked by the caller): no K masks in the loop.
    for _ in range(0, K // BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows[:, None] * y_stride + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def default_config(m: int, n: int, k: int) -> GemmConfig:
    """The launch shape for an [m, k] x [n, k]^T product (chosen from the H200 sweep in
    benchmarks/kernels/benchmark_gemm.py)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_k = 256 if k % 256 == 0 else 128
    # Enough programs to cover the SMs a few times over when N is small.
    block_n = 32 if n <= 8192 else 64
    return GemmConfig(block_m, block_n, block_k, num_warps=4, num_stages=3)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel handles this product (2-D, contiguous rows, 16-bit, K % 128 == 0)."""
    return (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] == weight.shape[1]
            and x.shape[1] % 128 == 0 and x.stride(1) == 1 and weight.stride(1) == 1)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N] (x @ weight^T, float32 accumulation)."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or default_config(m, n, k)
    if k % cfg.block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={cfg.block_k}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _skinny_gemm_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
