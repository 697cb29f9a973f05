"""Triton GEMM for decode-sized batches: y = x @ W^T with few rows, the weight streamed once.

At decode batch sizes a linear layer reads its whole weight for a handful of rows, so its cost
is the weight bytes over memory bandwidth. cuBLAS covers these shapes with split-K kernels
followed by a separate reduction kernel (two graph nodes per linear at batch 1), and at 32-64
rows picks tiles that stream the weight below copy bandwidth. This kernel gives each program
one [BLOCK_M, BLOCK_N] output tile over the whole K (no split, one launch, a fixed reduction
order for a given config), with the programs sharing a weight tile scheduled next to each other
so a weight tile read for the first block of rows is served from L2 for the next. Its
fp32 accumulation order differs from cuBLAS's, so results agree to rounding, not bitwise.

The kernel is used only for the shapes where it measured faster (``_TUNED``); the config
depends on (M bucket, N, K) only and is chosen when the model is loaded (a linear layer's
kernel table, ``linear.py``), so eager and graph replay at the same bucket run the same kernel
(the equality contract of docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from vllm import envs

# Triton reads the flag when kernels are defined, so once at import is enough.
_INTERPRETED = envs.TRITON_INTERPRET


@triton.jit
def _dot_acc(acc, x, w, DOT_F32: tl.constexpr):
    if DOT_F32:  # exact products either way; the interpreter's 16-bit dot is unreliable
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, x_stride, w_stride, y_stride,
                        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                        SILU_MUL: tl.constexpr = False):
    # Row blocks vary fastest: the programs reading one weight tile run back to back.
    # SILU_MUL: the weight is gate (rows [0, N)) | up (rows [N, 2N)); a program accumulates
    # both tiles of its columns and writes silu(gate) * up, each rounded as the separate
    # GEMM and ``silu_and_mul`` round them.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :]
    u_ptrs = w_ptrs + N * w_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of BLOCK_K (checked by the caller): no K masks in the loop.
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = _dot_acc(acc, x, w, DOT_F32)
        if SILU_MUL:
            u = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
            acc_u = _dot_acc(acc_u, x, u, DOT_F32)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # Rounded to the input dtype first, like the reference (a 16-bit linear, then .float()).
    dt = x_ptr.dtype.element_ty
    if SILU_MUL:
        g = acc.to(dt).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * acc_u.to(dt).to(tl.float32)).to(y_ptr.dtype.element_ty)
    else:
        y = acc.to(dt).to(y_ptr.dtype.element_ty)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * y_stride + cols[None, :]
    tl.store(y_ptrs, y, mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def default_config(m: int, n: int, k: int) -> GemmConfig:
    """A launch shape for any [m, k] x [n, k]^T product (the sweep's starting point)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_k = 256 if k % 256 == 0 else 128
    block_n = 32 if n <= 8192 else 64
    return GemmConfig(block_m, block_n, block_k, num_warps=4, num_stages=3)


# Shapes where this kernel beat cuBLAS and cuBLASLt on the H200 (bf16; time per call incl. the
# split-K reduction cuBLAS adds; `python -m benchmarks.kernels gemm`, see RESULTS.md), keyed
# by (row bucket, N, K). Everything else stays with cuBLAS.
_TUNED: dict[tuple[int, int, int], GemmConfig] = {
    # 4096 x 4096 (self-attention output, cross-attention query and output): 13.1 vs 14.4 us
    # at 1 row, 12.3 vs 14.2 us at 16; no split-K reduction node.
    (16, 4096, 4096): GemmConfig(16, 32, 256, num_warps=4, num_stages=4),
    # LM head 128256 x 4096: 238.6 vs 247.9 us (1 row), 247.5 vs 265.7 (32), 271.0 vs 281.3 (64).
    (16, 128256, 4096): GemmConfig(16, 64, 256, num_warps=4, num_stages=3),
    (32, 128256, 4096): GemmConfig(32, 128, 128, num_warps=4, num_stages=3),
    (64, 128256, 4096): GemmConfig(64, 128, 128, num_warps=8, num_stages=3),
}


def row_bucket(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 0))


_HALF = (torch.bfloat16, torch.float16)


def tuned_config(rows: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig | None:
    """The config for a [rows, k] x [n, k]^T product, or None where cuBLAS is faster."""
    return _TUNED.get((row_bucket(rows), n, k)) if dtype in _HALF else None


def linear_kernel(layer: Any, config: GemmConfig) -> Callable[..., torch.Tensor]:
    """A linear layer's kernel-table entry (``linear.LinearKernel``) running this GEMM on the
    layer's (bias-free) weight."""
    def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return skinny_gemm(x, layer.weight, config, out=out)

    return run


def silu_kernel(layer: Any, config: GemmConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gate|up layer's SiLU kernel-table entry (``linear.SiluKernel``)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        return skinny_gemm_silu(x, layer.weight, config)

    return run


# Gate|up projections with the SiLU-and-multiply in the epilogue (one launch instead of the
# GEMM and ``silu_and_mul``), where that measured faster than cuBLASLt's GEMM plus the
# activation kernel on the H200; keyed like ``_TUNED`` by (row bucket, 2 * intermediate, K).
# 11B gate|up (2 x 14336 x 4096), us per call incl. the activation
# (`python -m benchmarks.kernels gemm --silu`): 56.9 vs 57.5 at 1 row, 58.4 vs 59.2 at 16,
# 60.4 vs 60.8 at 32, 62.5 vs 63.6 at 64; and one graph node fewer per MLP.
_TUNED_SILU: dict[tuple[int, int, int], GemmConfig] = {
    (16, 28672, 4096): GemmConfig(16, 128, 128, num_warps=4, num_stages=3),
    (32, 28672, 4096): GemmConfig(32, 64, 256, num_warps=4, num_stages=3),
    (64, 28672, 4096): GemmConfig(64, 32, 128, num_warps=4, num_stages=3),
}


def tuned_silu_config(rows: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig | None:
    """The config of ``skinny_gemm_silu`` for ``rows`` inputs and a gate|up weight [n, k],
    or None where the GEMM and the separate activation are faster."""
    return _TUNED_SILU.get((row_bucket(rows), n, k)) if dtype in _HALF else None


def skinny_gemm_silu(x: torch.Tensor, weight: torch.Tensor,
                     config: GemmConfig | None = None) -> torch.Tensor:
    """x: [M, K], weight: [2I, K] (gate | up) -> silu(x @ gate^T) * (x @ up^T), [M, I]: each
    product rounded to x's dtype before the activation, as ``silu_and_mul(skinny_gemm(..))``
    computes it (bitwise the same with the same config)."""
    if weight.shape[0] % 2:
        raise ValueError(f"input of shape {tuple(x.shape)} for a weight of {tuple(weight.shape)}")
    return _launch(x, weight, weight.shape[0] // 2, config, None, silu_mul=True)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N] (x @ weight^T, float32 accumulation, rounded to
    x's dtype). ``out`` ([M, N], unit column stride) may be float32: the rounded values are
    widened, as ``linear(x, w).float()`` would give."""
    return _launch(x, weight, weight.shape[0], config, out, silu_mul=False)


def _launch(x: torch.Tensor, weight: torch.Tensor, n: int, config: GemmConfig | None,
            out: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """Checks the shapes and runs the kernel for an [M, n] output."""
    m = x.shape[0]
    k = weight.shape[1]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"input of shape {tuple(x.shape)} for a weight of {tuple(weight.shape)}")
    cfg = config or default_config(m, n, k)
    if k % cfg.block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={cfg.block_k}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(1) == 1
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _skinny_gemm_kernel[grid](x, weight, y, m, n, x.stride(0), weight.stride(0), y.stride(0),
                              K=k, DOT_F32=_INTERPRETED, SILU_MUL=silu_mul,
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
