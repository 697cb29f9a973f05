"""Triton weight-only GEMM on bitsandbytes 4-bit weights: y = x @ dequant(W)^T.

The weight stays in the checkpoint's bytes: packed 4-bit indices (two per byte, the even
element in the high nibble), one scale per block of ``blocksize`` elements of a row (an 8-bit
index into the dynamic table plus a second-level scale per 256 blocks with double quantization,
a float32 scale without). Each program dequantizes its weight tile in registers (code-table
lookup, block scale, both in float32, then one rounding to the activation dtype: the values
``bitsandbytes.functional.dequantize_4bit`` returns) and feeds it to ``tl.dot`` with float32
accumulation, over the whole K (no split, one launch, a fixed reduction order per config), the
row blocks sharing a weight tile scheduled next to each other as in ``skinny_gemm.py``.

A fused layer (q|k|v, gate|up) is one matrix: its shards' rows are stacked, each shard keeping
its own second-level scales and offset; ``shard_index`` ([S, 2]: first row, first second-level
scale) maps a row to them. The nested scale is ``table[u] * s + offset`` with the product
rounded before the sum, as bitsandbytes computes it: kernels launch with floating-point
contraction off (``enable_fp_fusion=False``), so no FMA merges the two.

``dequantize`` writes the whole matrix (for prefill-sized inputs, which then run a library GEMM
on it); the decode GEMM is chosen per row bucket at load (``quantization/bitsandbytes.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm import envs
from vllm.model_executor.layers.skinny_gemm import _dot_acc

# Triton reads the flag when kernels are defined, so once at import is enough.
_INTERPRETED = envs.TRITON_INTERPRET


@dataclass(frozen=True)
class QuantizedWeight:
    """A layer's 4-bit weight as the kernels read it (views of the layer's tensors)."""

    packed: torch.Tensor  # uint8 [N, K / 2]
    absmax: torch.Tensor  # [N, K / blocksize]: uint8 indices (nested) or float32 scales
    code: torch.Tensor  # float32 [16]: the NF4 or FP4 table
    blocksize: int
    nested_absmax: torch.Tensor | None = None  # float32 [groups of all shards]
    nested_code: torch.Tensor | None = None  # float32 [256]
    shard_index: torch.Tensor | None = None  # int32 [S, 2]: first row, first group
    shard_offsets: torch.Tensor | None = None  # float32 [S]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None


# Kernel signatures and calls stay one argument group a line, as in skinny_gemm.py (the
# formatter would put each of the two dozen arguments on a line of its own).
# fmt: off
@triton.jit
def _round_to(x, dt: tl.constexpr, EXACT_BF16: tl.constexpr):
    # float32 -> ``dt``, rounded to nearest even. Triton's interpreter truncates float32 to
    # bfloat16, so there (EXACT_BF16) the rounding is done on the bits; compiled, the cast
    # is the hardware's round-to-nearest-even.
    # One return statement: compiled Triton checks every return of a function for one type,
    # including those of constexpr branches not taken.
    if EXACT_BF16 and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        y = (bits >> 16).to(tl.uint16).to(dt, bitcast=True)
    else:
        y = x.to(dt)
    return y


@triton.jit
def _block_scales(s_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, rows, row_ok, j,
                  K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                  NUM_SHARDS: tl.constexpr):
    # float32 scales of blocks j ([J]) of ``rows`` ([R]) -> [R, J].
    kb: tl.constexpr = K // BLOCKSIZE
    idx = rows.to(tl.int64)[:, None] * kb + j[None, :]
    if NESTED:
        u = tl.load(s_ptr + idx, mask=row_ok[:, None], other=0).to(tl.int32)
        # The row's shard: its second-level scales and offset.
        shard = tl.zeros_like(rows)
        for i in tl.static_range(1, NUM_SHARDS):
            shard += (rows >= tl.load(sh_ptr + 2 * i)).to(tl.int32)
        start = tl.load(sh_ptr + 2 * shard)
        base = tl.load(sh_ptr + 2 * shard + 1)
        offset = tl.load(off_ptr + shard)
        local = (rows - start).to(tl.int64)[:, None] * kb + j[None, :]
        group = base.to(tl.int64)[:, None] + local // 256
        second = tl.load(n2_ptr + group, mask=row_ok[:, None], other=0.0)
        scales = tl.load(nc_ptr + u) * second + offset[:, None]
    else:
        scales = tl.load(s_ptr + idx, mask=row_ok[:, None], other=0.0).to(tl.float32)
    return scales


@triton.jit
def _dequant_tile(w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, rows, row_ok, k0,
                  K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                  NUM_SHARDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # float32 weights of ``rows`` ([BLOCK_N]) x columns [k0, k0 + BLOCK_K).
    half = tl.arange(0, BLOCK_K // 2)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * (K // 2) + (k0 // 2 + half)[None, :]
    b = tl.load(w_ptrs, mask=row_ok[:, None], other=0)
    # Element 2i is the high nibble of byte i, element 2i + 1 the low one.
    idx = tl.reshape(tl.join((b >> 4).to(tl.int32), (b & 15).to(tl.int32)), (BLOCK_N, BLOCK_K))
    values = tl.load(code_ptr + idx)
    if BLOCK_K >= BLOCKSIZE:  # whole blocks: one scale per block of each tile row
        per_row: tl.constexpr = BLOCK_K // BLOCKSIZE
        j = k0 // BLOCKSIZE + tl.arange(0, per_row)
        scales = _block_scales(s_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, rows, row_ok, j, K,
                               BLOCKSIZE, NESTED, NUM_SHARDS)
        blocks = tl.reshape(values, (BLOCK_N, per_row, BLOCKSIZE)) * scales[:, :, None]
        w = tl.reshape(blocks, (BLOCK_N, BLOCK_K))
    else:
        j = k0 // BLOCKSIZE + tl.arange(0, 1)  # the tile lies inside one block of each row
        scales = _block_scales(s_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, rows, row_ok, j, K,
                               BLOCKSIZE, NESTED, NUM_SHARDS)
        w = values * scales
    return w


@triton.jit
def _nf4_gemm_kernel(x_ptr, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, y_ptr,
                     M, N, x_stride, y_stride,
                     K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                     NUM_SHARDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, SILU_MUL: tl.constexpr):
    # Row blocks vary fastest: the programs dequantizing one weight tile run back to back.
    # SILU_MUL: rows [0, N) are gate, [N, 2N) up; the epilogue is silu(gate) * up, each
    # rounded as the separate GEMM and ``silu_and_mul`` round them.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + tl.arange(0, BLOCK_K)[None, :]
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of BLOCK_K (checked by the caller): no K masks in the loop.
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = _dequant_tile(w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, cols, col_ok,
                          k0, K, BLOCKSIZE, NESTED, NUM_SHARDS, BLOCK_N, BLOCK_K)
        acc = _dot_acc(acc, x, _round_to(w, dt, DOT_F32), DOT_F32)
        if SILU_MUL:
            u = _dequant_tile(w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, cols + N,
                              col_ok, k0, K, BLOCKSIZE, NESTED, NUM_SHARDS, BLOCK_N, BLOCK_K)
            acc_u = _dot_acc(acc_u, x, _round_to(u, dt, DOT_F32), DOT_F32)
        x_ptrs += BLOCK_K
    if SILU_MUL:
        g = acc.to(dt).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * acc_u.to(dt).to(tl.float32)).to(y_ptr.dtype.element_ty)
    else:
        y = acc.to(dt).to(y_ptr.dtype.element_ty)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * y_stride + cols[None, :]
    tl.store(y_ptrs, y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, out_ptr, N,
                    out_stride, K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                    NUM_SHARDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EXACT_BF16: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_ok = rows < N
    w = _dequant_tile(w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, rows, row_ok, k0,
                      K, BLOCKSIZE, NESTED, NUM_SHARDS, BLOCK_N, BLOCK_K)
    cols = k0 + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, _round_to(w, out_ptr.dtype.element_ty, EXACT_BF16), mask=row_ok[:, None])
# fmt: on


@dataclass(frozen=True)
class Nf4Config:
    """One launch shape of the GEMM."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def _block_k(k: int, preferred: int = 256) -> int:
    """The largest power of two <= ``preferred`` dividing K (K is a multiple of 32 at least:
    the smallest blocksize)."""
    b = preferred
    while k % b:
        b //= 2
    if b < 16:
        raise ValueError(f"K={k} has no tile width (a multiple of 16 is needed)")
    return b


def default_config(m: int, n: int, k: int) -> Nf4Config:
    """A launch shape for an [m, k] x [n, k]^T product. (A starting point: the configs of the
    decode buckets are to be tuned on the GPU, as the bf16 GEMM's were.)"""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 32 if n <= 8192 else 64
    return Nf4Config(block_m, block_n, _block_k(k, 128 if m > 32 else 256))


def _pointers(qw: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """The seven weight pointers in kernel order (placeholders where the format has none)."""
    if qw.nested:
        return (
            qw.packed,
            qw.absmax,
            qw.code,
            qw.nested_absmax,
            qw.nested_code,
            qw.shard_index,
            qw.shard_offsets,
        )  # type: ignore[return-value]
    return (qw.packed, qw.absmax, qw.code, qw.code, qw.code, qw.code, qw.code)


def _num_shards(qw: QuantizedWeight) -> int:
    return qw.shard_index.shape[0] if qw.shard_index is not None else 1


def dequantize(qw: QuantizedWeight, out: torch.Tensor, block_n: int = 32) -> torch.Tensor:
    """Writes the whole matrix into ``out`` ([N, K], unit column stride, the activation dtype):
    the values ``bitsandbytes.functional.dequantize_4bit`` gives, bitwise."""
    n, k = qw.shape
    assert out.shape == (n, k) and out.stride(1) == 1
    bk = min(_block_k(k), 128)
    grid = (triton.cdiv(n, block_n), k // bk)
    _dequant_kernel[grid](
        *_pointers(qw),
        out,
        n,
        out.stride(0),
        K=k,
        BLOCKSIZE=qw.blocksize,
        NESTED=qw.nested,
        NUM_SHARDS=_num_shards(qw),
        BLOCK_N=block_n,
        BLOCK_K=bk,
        EXACT_BF16=_INTERPRETED,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


def nf4_gemm(
    x: torch.Tensor,
    qw: QuantizedWeight,
    config: Nf4Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] -> [M, N] (float32 accumulation, rounded to x's dtype; float32 inputs take
    exact float32 products, not TF32). ``out`` ([M, N], unit column stride) may be float32: it
    receives the rounded values widened."""
    return _launch(x, qw, qw.shape[0], config, out, silu_mul=False)


def nf4_gemm_silu(
    x: torch.Tensor, qw: QuantizedWeight, config: Nf4Config | None = None
) -> torch.Tensor:
    """x [M, K], a gate|up weight [2I, K] -> silu(x @ gate^T) * (x @ up^T), [M, I]: bitwise
    ``silu_and_mul(nf4_gemm(x, qw, config))``."""
    n2 = qw.shape[0]
    if n2 % 2:
        raise ValueError(f"a gate|up weight needs an even row count, got {n2}")
    return _launch(x, qw, n2 // 2, config, None, silu_mul=True)


def _launch(
    x: torch.Tensor,
    qw: QuantizedWeight,
    n: int,
    config: Nf4Config | None,
    out: torch.Tensor | None,
    silu_mul: bool,
) -> torch.Tensor:
    """Checks the shapes and runs the GEMM for an [M, n] output."""
    m = x.shape[0]
    k = qw.shape[1]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"input of shape {tuple(x.shape)} for a weight of {qw.shape}")
    cfg = config or default_config(m, n, k)
    if k % cfg.block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={cfg.block_k}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(1) == 1
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _nf4_gemm_kernel[grid](
        x,
        *_pointers(qw),
        y,
        m,
        n,
        x.stride(0),
        y.stride(0),
        K=k,
        BLOCKSIZE=qw.blocksize,
        NESTED=qw.nested,
        NUM_SHARDS=_num_shards(qw),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_F32=_INTERPRETED or x.dtype == torch.float32,
        SILU_MUL=silu_mul,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )
    return y


def linear_kernel(qw: QuantizedWeight, config: Nf4Config) -> Callable[..., torch.Tensor]:
    """A kernel-table entry (``linear.LinearKernel``) running this GEMM."""

    def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return nf4_gemm(x, qw, config, out=out)

    return run


def silu_kernel(qw: QuantizedWeight, config: Nf4Config) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gate|up layer's SiLU kernel-table entry (``linear.SiluKernel``)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        return nf4_gemm_silu(x, qw, config)

    return run
