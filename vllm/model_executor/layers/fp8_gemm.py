"""Triton weight-only GEMM on FP8 weights with per-output-channel scales: y = (x @ W^T) * s.

The weight stays as the checkpoint stores it, float8_e4m3fn [N, K], with one float32 scale per
output row (a per-tensor checkpoint scale is repeated over its rows at load). Each program
converts its weight tile to the activation dtype in registers (exact: every e4m3 value is a
bf16 and an fp16 value) and feeds it to ``tl.dot`` with float32 accumulation over the whole K
(no split, one launch, a fixed reduction order per config); the channel scale multiplies the
float32 accumulator in the epilogue, and the product is rounded once to the activation dtype.
Activations are never quantized. Row blocks sharing a weight tile run next to each other, as in
``skinny_gemm.py``.

The epilogue scale is the exact product of the weight and its scale; the reference
(compressed-tensors' decompression, ``quantization/fp8.py``) first rounds every weight to the
scale's dtype. The two differ by at most half an ulp of that dtype per weight, and decode
results are compared with the reference by ``check_logprobs_close``, as for any other kernel.

``dequantize`` writes the whole matrix with the reference's rounding (for prefill-sized inputs,
which then run a library GEMM on it, bitwise the torch path); the decode GEMM is chosen per row
bucket at load (``quantization/fp8.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm import envs
from vllm.model_executor.layers.nf4_gemm import _round_to
from vllm.model_executor.layers.skinny_gemm import _dot_acc

# Triton reads the flag when kernels are defined, so once at import is enough.
_INTERPRETED = envs.TRITON_INTERPRET


# Kernel signatures and calls stay one argument group a line, as in skinny_gemm.py.
# fmt: off
@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, x_stride, y_stride,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, SILU_MUL: tl.constexpr):
    # Row blocks vary fastest: the programs converting one weight tile run back to back.
    # SILU_MUL: rows [0, N) are gate, [N, 2N) up; the epilogue is silu(gate) * up, each
    # rounded as the separate GEMM and ``silu_and_mul`` round them.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    u_ptrs = w_ptr + (cols + N).to(tl.int64)[:, None] * K + ks[None, :]
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of BLOCK_K (checked by the caller): no K masks in the loop.
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = _dot_acc(acc, x, w.to(dt), DOT_F32)
        if SILU_MUL:
            u = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
            acc_u = _dot_acc(acc_u, x, u.to(dt), DOT_F32)
            u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    if SILU_MUL:
        scale_u = tl.load(s_ptr + N + cols, mask=col_ok, other=0.0)
        g = (acc * scale[None, :]).to(dt).to(tl.float32)
        up = (acc_u * scale_u[None, :]).to(dt).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * up).to(y_ptr.dtype.element_ty)
    else:
        y = (acc * scale[None, :]).to(dt).to(y_ptr.dtype.element_ty)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * y_stride + cols[None, :]
    tl.store(y_ptrs, y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, out_stride, K: tl.constexpr,
                    SCALE_DT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EXACT_BF16: tl.constexpr):
    # out = (w * s rounded to the scale dtype) rounded to out's dtype, as the reference.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < N
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=row_ok[:, None],
                other=0.0)
    s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    v = _round_to(w.to(tl.float32) * s[:, None], SCALE_DT, EXACT_BF16).to(tl.float32)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, _round_to(v, out_ptr.dtype.element_ty, EXACT_BF16), mask=row_ok[:, None])
# fmt: on


@dataclass(frozen=True)
class Fp8Weight:
    """A layer's FP8 weight as the kernels read it (views of the layer's tensors)."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N]
    scale_dtype: torch.dtype  # the dtype the reference rounds weight x scale to

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]


@dataclass(frozen=True)
class Fp8Config:
    """One launch shape of the GEMM."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def _block_k(k: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` dividing K (at least 16: ``tl.dot``)."""
    b = preferred
    while k % b:
        b //= 2
    if b < 16:
        raise ValueError(f"K={k} has no tile width (a multiple of 16 is needed)")
    return b


def default_config(m: int, n: int, k: int) -> Fp8Config:
    """A launch shape for an [m, k] x [n, k]^T product. (A starting point: the configs of the
    decode buckets are to be tuned on the GPU with ``benchmarks/kernels/fp8.py``.)"""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    # Decode is bandwidth-bound: the widest column block that still gives every SM (132 on an
    # H200) about two programs streaming weights (o_proj's 4096 rows: 256 blocks of 16).
    block_n = next((b for b in (64, 32) if n // b >= 256), 16)
    return Fp8Config(block_m, block_n, _block_k(k, 128 if m > 32 else 256))


def _triton_dtype(dtype: torch.dtype) -> tl.dtype:
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[
        dtype
    ]


def dequantize(fw: Fp8Weight, out: torch.Tensor, block_n: int = 32) -> torch.Tensor:
    """Writes the whole matrix into ``out`` ([N, K], unit column stride, the activation dtype):
    the reference's values, bitwise (``quantization/fp8.py: dequantize``)."""
    n, k = fw.shape
    assert out.shape == (n, k) and out.stride(1) == 1
    bk = _block_k(k, 128)
    grid = (triton.cdiv(n, block_n), k // bk)
    _dequant_kernel[grid](
        fw.weight,
        fw.scale,
        out,
        n,
        out.stride(0),
        K=k,
        SCALE_DT=_triton_dtype(fw.scale_dtype),
        BLOCK_N=block_n,
        BLOCK_K=bk,
        EXACT_BF16=_INTERPRETED,
        num_warps=4,
    )
    return out


def fp8_gemm(
    x: torch.Tensor,
    fw: Fp8Weight,
    config: Fp8Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] -> [M, N] (float32 accumulation, the channel scale on the accumulator, rounded
    to x's dtype; float32 inputs take exact float32 products, not TF32). ``out`` ([M, N], unit
    column stride) may be float32: it receives the rounded values widened."""
    return _launch(x, fw, fw.shape[0], config, out, silu_mul=False)


def fp8_gemm_silu(x: torch.Tensor, fw: Fp8Weight, config: Fp8Config | None = None) -> torch.Tensor:
    """x [M, K], a gate|up weight [2I, K] -> silu(x @ gate^T) * (x @ up^T), [M, I]: bitwise
    ``silu_and_mul(fp8_gemm(x, fw, config))``."""
    n2 = fw.shape[0]
    if n2 % 2:
        raise ValueError(f"a gate|up weight needs an even row count, got {n2}")
    return _launch(x, fw, n2 // 2, config, None, silu_mul=True)


def _launch(
    x: torch.Tensor,
    fw: Fp8Weight,
    n: int,
    config: Fp8Config | None,
    out: torch.Tensor | None,
    silu_mul: bool,
) -> torch.Tensor:
    """Checks the shapes and runs the GEMM for an [M, n] output."""
    m = x.shape[0]
    k = fw.shape[1]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"input of shape {tuple(x.shape)} for a weight of {fw.shape}")
    cfg = config or default_config(m, n, k)
    if k % cfg.block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={cfg.block_k}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(1) == 1
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _fp8_gemm_kernel[grid](
        x,
        fw.weight,
        fw.scale,
        y,
        m,
        n,
        x.stride(0),
        y.stride(0),
        K=k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_F32=_INTERPRETED or x.dtype == torch.float32,
        SILU_MUL=silu_mul,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y


def linear_kernel(fw: Fp8Weight, config: Fp8Config) -> Callable[..., torch.Tensor]:
    """A kernel-table entry (``linear.LinearKernel``) running this GEMM."""

    def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return fp8_gemm(x, fw, config, out=out)

    return run


def silu_kernel(fw: Fp8Weight, config: Fp8Config) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gate|up layer's SiLU kernel-table entry (``linear.SiluKernel``)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        return fp8_gemm_silu(x, fw, config)

    return run
