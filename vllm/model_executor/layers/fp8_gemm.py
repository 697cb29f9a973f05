"""Triton weight-only GEMM on FP8 weights with per-output-channel scales: y = (x @ W^T) * s.

The weight stays as the checkpoint stores it, float8_e4m3fn [N, K], with one float32 scale per
output row (a per-tensor checkpoint scale is repeated over its rows at load). Each program
converts its weight tile in registers (exact: every e4m3 value is a bf16, an fp16 and an fp32
value; to bf16 by integer bit moves, not the conversion unit, see ``_E4M3X4_PTX``) and
multiplies it with the activations, summing in float32; the channel scale multiplies
the float32 sum in the epilogue, and the product is rounded once to the activation dtype.
Activations are never quantized. Row tiles of at most ``MAX_CUDA_CORE_ROWS`` rows can multiply
on the CUDA cores, products summed per lane and reduced once after the K loop; tiles of 16
rows and up feed ``tl.dot`` on the tensor cores, a 16-row tile serving the small decode
buckets too (their time is all reading the weight, which is the same). Where the output tiles
are too few to keep the memory system busy, K is split over programs whose float32 partial
sums a second kernel adds in split order (the swapped kernel: its last program of a tile, in
the same launch): a fixed reduction order per config, as the graph contract needs. Row blocks
sharing a weight tile run next to each other, as in ``skinny_gemm.py``.

The epilogue scale is the exact product of the weight and its scale; the reference
(compressed-tensors' decompression, ``quantization/fp8.py``) first rounds every weight to the
scale's dtype. The two differ by at most half an ulp of that dtype per weight, and decode
results are compared with the reference by ``check_logprobs_close``, as for any other kernel.

``dequantize`` writes the whole matrix with the reference's rounding (for prefill-sized inputs,
which then run a library GEMM on it, bitwise the torch path); the decode GEMM is chosen per row
bucket at load (``quantization/fp8.py``): a GPU model's tuned table (``fp8_configs/``, written
by ``benchmarks/kernels/fp8.py --sweep --table``) gives each shape and row count its config or
the scratch path where it measured faster, ``default_config`` the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from vllm import envs
from vllm.model_executor.layers.nf4_gemm import _round_to
from vllm.model_executor.layers.skinny_gemm import _dot_acc
from vllm.model_executor.layers.split_k import arrive_last, reset_counter, sum_partials, tile_count
from vllm.model_executor.layers.tuned_configs import TunedTables

# Triton reads the flag when kernels are defined, so once at import is enough.
_INTERPRETED = envs.TRITON_INTERPRET


# Kernel signatures and calls stay one argument group a line, as in skinny_gemm.py.
# fmt: off
@triton.jit
def _scaled_epilogue(acc, acc_u, scale, scale_u, dt: tl.constexpr, out_dt: tl.constexpr,
                     SILU_MUL: tl.constexpr):
    # The channel scale on the float32 sums, rounded to the activation dtype as a 16-bit
    # linear's output is; with SILU_MUL silu(gate) * up, each rounded as the separate GEMM and
    # ``silu_and_mul`` round them.
    g = (acc * scale[None, :]).to(dt).to(tl.float32)
    if SILU_MUL:
        up = (acc_u * scale_u[None, :]).to(dt).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * up).to(out_dt)
    else:
        y = g.to(out_dt)
    return y


@triton.jit
def _finish(acc, acc_u, s_ptr, y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N, y_stride, pid_k,
            dt: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr):
    # Without a K split: the epilogue and the output. With one: the unscaled float32 partial
    # sums ([SPLIT_K, M, N], twice N with SILU_MUL) for ``_split_reduce_kernel``.
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        scale = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
        scale_u = scale
        if SILU_MUL:
            scale_u = tl.load(s_ptr + N + cols, mask=col_ok, other=0.0)
        y = _scaled_epilogue(acc, acc_u, scale, scale_u, dt, y_ptr.dtype.element_ty, SILU_MUL)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * y_stride + cols[None, :], y, mask=mask)
    else:
        width = 2 * N if SILU_MUL else N
        p_ptrs = p_ptr + (pid_k * M + rows.to(tl.int64))[:, None] * width + cols[None, :]
        tl.store(p_ptrs, acc, mask=mask)
        if SILU_MUL:
            tl.store(p_ptrs + N, acc_u, mask=mask)


@triton.jit
def _program_tile(M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # Program (m, n, s) of either GEMM: its rows and weight rows (columns of y), their masks,
    # and the first K tile of its split, [s * K / SPLIT_K, ... + BLOCK_K).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * (K // SPLIT_K) + tl.arange(0, BLOCK_K)
    return pid_m, pid_n, pid_k, rows, cols, rows < M, cols < N, ks


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, p_ptr, M, N, x_stride, y_stride,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, CUDA_CORES: tl.constexpr,
                     DOT_F32: tl.constexpr, SILU_MUL: tl.constexpr, PTX: tl.constexpr):
    # Row blocks vary fastest: the programs converting one weight tile run back to back.
    # Program (m, n, s) sums K range [s * K / SPLIT_K, (s + 1) * K / SPLIT_K) of its tile.
    # SILU_MUL: weight rows [0, N) are gate, [N, 2N) up.
    pid_m, pid_n, pid_k, rows, cols, row_ok, col_ok, ks = _program_tile(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    per_split: tl.constexpr = K // SPLIT_K
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    u_ptrs = w_ptr + (cols + N).to(tl.int64)[:, None] * K + ks[None, :]
    dt = x_ptr.dtype.element_ty
    if CUDA_CORES:  # per-lane float32 sums of exact products, reduced after the loop
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for _ in range(0, per_split, BLOCK_K):
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
            w = _convert(tl.load(w_ptrs, mask=col_ok[:, None], other=0.0), dt, True, PTX)
            acc3 += x[:, None, :] * w[None, :, :]
            if SILU_MUL:
                u = _convert(tl.load(u_ptrs, mask=col_ok[:, None], other=0.0), dt, True, PTX)
                acc3_u += x[:, None, :] * u[None, :, :]
                u_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = tl.sum(acc3, axis=2)
        acc_u = tl.sum(acc3_u, axis=2)
    else:  # tensor cores: the tile converted to the activation dtype (exact)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, per_split, BLOCK_K):
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            acc = _dot_acc(acc, x, _convert(w, dt, False, PTX), DOT_F32)
            if SILU_MUL:
                u = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
                acc_u = _dot_acc(acc_u, x, _convert(u, dt, False, PTX), DOT_F32)
                u_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    _finish(acc, acc_u, s_ptr, y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N, y_stride, pid_k,
            dt, SPLIT_K, SILU_MUL)


@triton.jit
def _fp8_swap_kernel(x_ptr, w_ptr, s_ptr, y_ptr, p_ptr, c_ptr, M, N, x_stride, y_stride,
                     K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
                     SILU_MUL: tl.constexpr, PTX: tl.constexpr):
    # Tensor cores with the roles swapped: the converted weight tile [BLOCK_N, BLOCK_K] is the
    # dot's first operand and x^T [BLOCK_K, BLOCK_M] the second, so a decode step's few rows
    # fill the dot's narrow side. Grid and K ranges as ``_fp8_gemm_kernel``; a K split is
    # summed in this launch (``split_k.py``).
    pid_m, pid_n, pid_k, rows, cols, row_ok, col_ok, ks = _program_tile(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    per_split: tl.constexpr = K // SPLIT_K
    xt_ptrs = x_ptr + rows.to(tl.int64)[None, :] * x_stride + ks[:, None]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    u_ptrs = w_ptr + (cols + N).to(tl.int64)[:, None] * K + ks[None, :]
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, per_split, BLOCK_K):
        xt = tl.load(xt_ptrs, mask=row_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = _dot_swapped(acc, w, xt, dt, DOT_F32, PTX)
        if SILU_MUL:
            u = tl.load(u_ptrs, mask=col_ok[:, None], other=0.0)
            acc_u = _dot_swapped(acc_u, u, xt, dt, DOT_F32, PTX)
            u_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = tl.trans(acc)
    out_u = tl.trans(acc_u)
    if SPLIT_K == 1:
        _finish(out, out_u, s_ptr, y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N, y_stride,
                pid_k, dt, 1, SILU_MUL)
    else:
        _finish(out, out_u, s_ptr, y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N, y_stride,
                pid_k, dt, SPLIT_K, SILU_MUL)
        tile = pid_n * tl.num_programs(0) + pid_m
        if arrive_last(c_ptr, tile, SPLIT_K):
            width = 2 * N if SILU_MUL else N
            mask = row_ok[:, None] & col_ok[None, :]
            out = sum_partials(p_ptr, rows, cols, mask, M, width, BLOCK_M, BLOCK_N, SPLIT_K)
            if SILU_MUL:
                out_u = sum_partials(p_ptr + N, rows, cols, mask, M, width, BLOCK_M, BLOCK_N,
                                     SPLIT_K)
            reset_counter(c_ptr, tile)
            _finish(out, out_u, s_ptr, y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N,
                    y_stride, pid_k, dt, 1, SILU_MUL)


@triton.jit
def _dot_swapped(acc, w, xt, dt: tl.constexpr, DOT_F32: tl.constexpr, PTX: tl.constexpr):
    # acc [BLOCK_N, BLOCK_M] += W tile (FP8, converted exactly) @ x^T.
    if DOT_F32:  # exact products either way; the interpreter's 16-bit dot is unreliable
        return tl.dot(_convert(w, dt, True, PTX, 2), xt.to(tl.float32), acc,
                      input_precision="ieee")
    return tl.dot(_convert(w, dt, False, PTX, 2), xt, acc)


# e4m3 -> bf16 by bit moves: each byte b is placed in the high byte of a 16-bit half (prmt),
# its 7 magnitude bits shifted down 4 and its sign kept in place. The halves are then b's value
# times 2^-120 as bfloat16 (subnormal codes land on bf16 subnormals, zero on zero), and one
# packed multiply by 2^120 (an FMA adding -0, which keeps the sign of zero) makes them exact:
# 2.5 integer and half-precision instructions a value, none on the conversion unit, whose
# issue rate bounds the generic path (e4m3x2 -> f16x2, then f16 -> bf16 a value) below the
# memory's in a decode GEMM. The two NaN codes (never in a checkpoint: quantizers saturate)
# become +-480. Two forms: four values a 32-bit register (tiles loaded 4 bytes a thread) and
# two (the swapped kernel's dot operand, read 2 bytes at a time).
_E4M3X4_PTX = tl.constexpr("""{
.reg .b32 h0, h1, t0, t1, k, z;
prmt.b32 h0, $2, 0, 0x1404;
prmt.b32 h1, $2, 0, 0x3424;
shr.b32 t0, h0, 4;
shr.b32 t1, h1, 4;
and.b32 t0, t0, 0x07F007F0;
and.b32 t1, t1, 0x07F007F0;
and.b32 h0, h0, 0x80008000;
and.b32 h1, h1, 0x80008000;
or.b32 t0, t0, h0;
or.b32 t1, t1, h1;
mov.b32 k, 0x7B807B80;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, t0, k, z;
fma.rn.bf16x2 $1, t1, k, z;
}""")
_E4M3X2_PTX = tl.constexpr("""{
.reg .b32 w, h, t, k, z;
cvt.u32.u16 w, $1;
prmt.b32 h, w, 0, 0x1404;
shr.b32 t, h, 4;
and.b32 t, t, 0x07F007F0;
and.b32 h, h, 0x80008000;
or.b32 t, t, h;
mov.b32 k, 0x7B807B80;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, t, k, z;
}""")


@triton.jit
def _e4m3_to_bf16(w, PTX: tl.constexpr, PACK: tl.constexpr):
    # float8_e4m3fn -> bfloat16, exact. Compiled, the PTX above (PACK values an instance);
    # the interpreter makes the same 2^-120-scaled value as a float32 (sign and magnitude
    # bits moved into its top bits) and multiplies by 2^120 there.
    u = w.to(tl.uint8, bitcast=True)
    if PTX and PACK == 4:
        y = tl.inline_asm_elementwise(_E4M3X4_PTX, "=r,=r,r", [u], dtype=tl.bfloat16,
                                      is_pure=True, pack=4)
    elif PTX:
        y = tl.inline_asm_elementwise(_E4M3X2_PTX, "=r,h", [u], dtype=tl.bfloat16,
                                      is_pure=True, pack=2)
    else:
        v = u.to(tl.uint32)
        bits = ((v & 0x7F) << 20) | ((v & 0x80) << 24)
        y = (bits.to(tl.float32, bitcast=True) * 1.329227995784916e36).to(tl.bfloat16)
    return y


@triton.jit
def _convert(w, dt: tl.constexpr, F32: tl.constexpr, PTX: tl.constexpr, PACK: tl.constexpr = 4):
    # A loaded FP8 tile as a dot operand: ``dt`` (float32 with F32), exact either way.
    if dt == tl.bfloat16:
        y = _e4m3_to_bf16(w, PTX, PACK)
        if F32:
            y = y.to(tl.float32)
    else:
        y = w.to(tl.float32) if F32 else w.to(dt)
    return y


@triton.jit
def _split_reduce_kernel(p_ptr, s_ptr, y_ptr, M, N, y_stride, SPLIT_K: tl.constexpr,
                         SILU_MUL: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):
    # y = epilogue(sum over splits, in split order, of the partial sums).
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    m = (i // N).to(tl.int64)
    n = i % N
    width = 2 * N if SILU_MUL else N
    acc = tl.zeros((1, BLOCK), dtype=tl.float32)
    acc_u = tl.zeros((1, BLOCK), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ptrs = p_ptr + (s * M + m) * width + n
        acc += tl.load(ptrs, mask=ok, other=0.0)[None, :]
        if SILU_MUL:
            acc_u += tl.load(ptrs + N, mask=ok, other=0.0)[None, :]
    scale = tl.load(s_ptr + n, mask=ok, other=0.0)
    scale_u = scale
    if SILU_MUL:
        scale_u = tl.load(s_ptr + N + n, mask=ok, other=0.0)
    y = _scaled_epilogue(acc, acc_u, scale, scale_u, DT, y_ptr.dtype.element_ty, SILU_MUL)
    tl.store(y_ptr + m * y_stride + n, tl.reshape(y, (BLOCK,)), mask=ok)


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
    # int32 zeros, one per output tile: the swapped kernel's K-split arrival counts (each
    # tile's last program resets its count). None: that kernel runs without a K split.
    counters: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]


MAX_CUDA_CORE_ROWS = 8  # row tiles up to this many rows multiply on the CUDA cores
MIN_TILE = 16  # the swapped kernel's smallest row and column tiles (``tl.dot``)


def make_counters(n_out: int, max_rows: int, device: torch.device) -> torch.Tensor:
    """Counters for the swapped kernel's K splits on an ``n_out``-column output of up to
    ``max_rows`` rows: one per output tile of the smallest tiles."""
    tiles = tile_count(n_out, max_rows, MIN_TILE)
    return torch.zeros(tiles, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Fp8Config:
    """One launch shape of the GEMM: row, column and K tile, and the K split (programs per
    tile, summed by a second kernel in split order). Row tiles of at most
    ``MAX_CUDA_CORE_ROWS`` run on the CUDA cores, wider ones (16 and up) on the tensor cores.
    ``swap``: the tensor-core kernel with the weight tile as the dot's first operand (row and
    column tiles of 16 and up), its K split summed in the same launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False

    @property
    def cuda_cores(self) -> bool:
        return self.block_m <= MAX_CUDA_CORE_ROWS and not self.swap

    def fits(self, k: int) -> bool:
        """Whether K divides into this config's splits and tiles."""
        return k % (self.split_k * self.block_k) == 0


def _block_k(k: int, preferred: int) -> int:
    """The largest power of two <= ``preferred`` dividing K (at least 16: ``tl.dot``)."""
    b = preferred
    while k % b:
        b //= 2
    if b < 16:
        raise ValueError(f"K={k} has no tile width (a multiple of 16 is needed)")
    return b


def default_config(m: int, n: int, k: int) -> Fp8Config:
    """A launch shape for an [m, k] x [n, k]^T product where no tuned table has one: the
    pattern of the H200 sweep's winners on the 11B shapes (``benchmarks/RESULTS.md``). Up to
    16 rows the tensor-core kernel with a 16-row tile (fewer rows read the same weight), K
    tiles of 256: 64 weight rows a tile and no K split for wide outputs (8192 columns and
    up), else 32 and K split in two; up to 64 rows the swapped kernel with 64 weight rows a
    tile, K split in four where the tiles are few."""
    if m <= 16:
        wide = n >= 8192
        return _fitted(Fp8Config(16, 64 if wide else 32, _block_k(k, 256), 1 if wide else 2), k)
    if m <= 64:
        split = 4 if triton.cdiv(n, 64) < 128 else 1
        block_m = 32 if m <= 32 else 64
        return _fitted(Fp8Config(block_m, 64, _block_k(k, 128), split, num_stages=4, swap=True), k)
    block_m = 64
    # The widest column block that still gives every SM about two programs streaming weights
    # (o_proj's 4096 rows: 256 blocks of 16).
    block_n = next((b for b in (64, 32) if n // b >= 256), 16)
    return Fp8Config(block_m, block_n, _block_k(k, 128))


def _fitted(cfg: Fp8Config, k: int) -> Fp8Config:
    """``cfg`` with its K split halved until its tiles divide K."""
    while cfg.split_k > 1 and not cfg.fits(k):
        cfg = replace(cfg, split_k=cfg.split_k // 2)
    return cfg


TUNED = TunedTables(Path(__file__).with_name("fp8_configs"), Fp8Config)
tuned_table_path = TUNED.path  # a GPU model's table (``benchmarks.kernels fp8 --table``)


def table_key(n: int, k: int, silu: bool) -> str:
    return f"n={n},k={k}" + (",silu" if silu else "")


def decode_config(
    m: int, n: int, k: int, silu: bool = False, device_name: str = ""
) -> Fp8Config | None:
    """What ``m`` rows run: the GEMM with this config, or None for the scratch path. The
    tuned table's entry for this GPU and shape (that of the smallest tuned row count >= m)
    where there is one, else ``default_config``."""
    found, cfg = TUNED.lookup(device_name, table_key(n, k, silu), m)
    if found and (cfg is None or cfg.fits(k)):
        return cfg
    return default_config(m, n, k)


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
    if config is None and cfg.swap and cfg.split_k > 1 and fw.counters is None:
        cfg = replace(cfg, split_k=1)  # the default on a weight without split counters
    if not cfg.fits(k):
        raise ValueError(f"K={k} does not divide into {cfg}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(1) == 1
    if cfg.swap:
        return _launch_swapped(x, fw, n, cfg, y, silu_mul)
    partial = y  # unused without a K split
    if cfg.split_k > 1:
        width = 2 * n if silu_mul else n
        partial = torch.empty((cfg.split_k, m, width), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _fp8_gemm_kernel[grid](
        x, fw.weight, fw.scale, y, partial,
        m, n, x.stride(0), y.stride(0),
        K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, CUDA_CORES=cfg.cuda_cores,
        DOT_F32=_INTERPRETED or x.dtype == torch.float32, SILU_MUL=silu_mul,
        PTX=not _INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.split_k > 1:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            partial, fw.scale, y, m, n, y.stride(0),
            SPLIT_K=cfg.split_k, SILU_MUL=silu_mul, BLOCK=block, DT=_triton_dtype(x.dtype),
            num_warps=4,
        )  # fmt: skip
    return y


def _launch_swapped(
    x: torch.Tensor, fw: Fp8Weight, n: int, cfg: Fp8Config, y: torch.Tensor, silu_mul: bool
) -> torch.Tensor:
    m, k = x.shape
    if min(cfg.block_m, cfg.block_n) < MIN_TILE:
        raise ValueError(f"{cfg}: the swapped kernel's tiles are {MIN_TILE} wide and up")
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    partial = counters = y  # unused without a K split
    if cfg.split_k > 1:
        counters = fw.counters
        if counters is None or counters.numel() < grid[0] * grid[1]:
            raise ValueError(f"{cfg} on {m} x {n}: the weight has no counters for its tiles")
        width = 2 * n if silu_mul else n
        partial = torch.empty((cfg.split_k, m, width), dtype=torch.float32, device=x.device)
    _fp8_swap_kernel[grid](
        x, fw.weight, fw.scale, y, partial, counters,
        m, n, x.stride(0), y.stride(0),
        K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, DOT_F32=_INTERPRETED or x.dtype == torch.float32,
        SILU_MUL=silu_mul, PTX=not _INTERPRETED, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
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
