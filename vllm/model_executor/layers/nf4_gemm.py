"""Triton weight-only GEMM on bitsandbytes 4-bit weights: y = x @ dequant(W)^T.

The weight stays in the checkpoint's bytes: packed 4-bit indices (two per byte, the even
element in the high nibble), one scale per block of ``blocksize`` elements of a row (an 8-bit
index into the dynamic table plus a second-level scale per 256 blocks with double quantization,
a float32 scale without). Each program dequantizes its weight tile in registers (code-table
lookup, block scale, both in float32, then one rounding to the activation dtype: the values
``bitsandbytes.functional.dequantize_4bit`` returns) one scale block at a time and multiplies
it in on the CUDA cores: a decode step's few rows against the whole weight, which is all the
time reading and decoding the weight. The block's even elements (high nibbles) and odd ones
(low nibbles) are multiplied separately with the matching strided columns of x, so nibbles are
never interleaved; products are summed per lane and reduced once after the K loop. Where the
output tiles are too few to keep the memory system busy, K is split over programs whose
float32 partial sums a second kernel adds in split order: a fixed reduction order per config,
as the graph contract needs.

The table kernel (``Nf4Config.table``, 16-bit activations, any row count) runs on the tensor
cores instead: per scale block it computes the block's 16 possible values (the same products
and rounding) and packs them into eight 32-bit words of byte planes, which byte permutes
(``prmt``) index with the packed nibbles directly, eight values per 22 integer instructions
and no memory gathers (``_LUT_PTX``); the looked-up tile meets x in ``tl.dot``. It is what
16-bit inputs run at every decode size unless the tuned table says otherwise.

The pair kernel (``Nf4Config.pairs``, 16-bit activations, 1, 2 or 4 rows a tile) builds the
same tables with two conversions and two permutes per four entries (``_TABLE_PTX_BF16``) and
looks each 32-bit word of packed weight up as four 16-bit pairs (``_PAIR_PTX``), which meet
the matching pairs of x on the CUDA cores. Each thread holds whole scale blocks of its weight
rows, so every operand is loaded in the layout it is used in: no shared memory, no barrier,
6.5 instructions a value at one row (``python -m benchmarks.kernels sass nf4 --pairs``)
against the table kernel's 7.2 with a third of them moving data between threads. Row counts
without a GEMM config (and any the tuned table gives to it) take the scratch path: the whole
matrix dequantized, then a library GEMM.

A fused layer (q|k|v, gate|up) is one matrix: its shards' rows are stacked, each shard keeping
its own second-level scales and offset; ``shard_index`` ([S, 2]: first row, first second-level
scale) maps a row to them. The nested scale is ``table[u] * s + offset`` with the product
rounded before the sum, as bitsandbytes computes it: the dequantize kernel launches with
floating-point contraction off (``enable_fp_fusion=False``) and the GEMM rounds that product
with an explicit ``mul.rn``, so no FMA merges the two.

``dequantize`` writes the whole matrix (for prefill-sized inputs, which then run a library GEMM
on it); the decode GEMM is chosen per row bucket at load (``quantization/bitsandbytes.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from vllm import envs
from vllm.model_executor.layers.tuned_configs import TunedTables

# Triton reads the flag when kernels are defined, so once at import is enough.
_INTERPRETED = envs.TRITON_INTERPRET
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


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
def _epilogue(acc, acc_u, dt: tl.constexpr, out_dt: tl.constexpr, SILU_MUL: tl.constexpr):
    # Rounded to the activation dtype first, like the reference (a 16-bit linear); with
    # SILU_MUL silu(gate) * up, each rounded as the separate GEMM and ``silu_and_mul`` round.
    if SILU_MUL:
        g = acc.to(dt).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * acc_u.to(dt).to(tl.float32)).to(out_dt)
    else:
        y = acc.to(dt).to(out_dt)
    return y


@triton.jit
def _shard_of(sh_ptr, off_ptr, wrows, NUM_SHARDS: tl.constexpr):
    # Per weight row: its shard's first row, first second-level scale and offset.
    shard = tl.zeros_like(wrows)
    for i in tl.static_range(1, NUM_SHARDS):
        shard += (wrows >= tl.load(sh_ptr + 2 * i)).to(tl.int32)
    return tl.load(sh_ptr + 2 * shard), tl.load(sh_ptr + 2 * shard + 1), tl.load(off_ptr + shard)


@triton.jit
def _mul_rn(a, b, EXACT_MUL: tl.constexpr):
    # a * b rounded on its own: never contracted into an FMA with a later add (the nested
    # scale is ``table[u] * s + offset`` with the product rounded first, as bitsandbytes has
    # it). Compiled, an explicit ``mul.rn``; the interpreter never fuses.
    if EXACT_MUL:
        y = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = a * b
    return y


@triton.jit
def _block_product(acc, x_ptr, x_stride, rows, row_ok, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr,
                   wrows, wrow_ok, start, base, offset, j,
                   K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                   EXACT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr):
    # acc ([BLOCK_M, BLOCK_N, BLOCKSIZE / 2] partial products, reduced after the K loop) +=
    # x[rows, block j] * W[wrows, block j], the block's weights dequantized here. The block's
    # even elements are the high nibbles, the odd ones the low nibbles: each meets the
    # matching strided columns of x, so nibbles are never interleaved. The 16-entry code table
    # is one cache line: a warp's lookups into it are served at once.
    HALF: tl.constexpr = BLOCKSIZE // 2
    kb: tl.constexpr = K // BLOCKSIZE
    half = tl.arange(0, HALF)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + (j * BLOCKSIZE + 2 * half)[None, :]
    xe = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    xo = tl.load(x_ptrs + 1, mask=row_ok[:, None], other=0.0).to(tl.float32)
    wr = wrows.to(tl.int64)
    b = tl.load(w_ptr + wr[:, None] * (K // 2) + (j * HALF + half)[None, :],
                mask=wrow_ok[:, None], other=0).to(tl.int32)
    hi = tl.load(code_ptr + (b >> 4))
    lo = tl.load(code_ptr + (b & 15))
    if NESTED:
        u = tl.load(s_ptr + wr * kb + j, mask=wrow_ok, other=0).to(tl.int32)
        group = base.to(tl.int64) + ((wrows - start).to(tl.int64) * kb + j) // 256
        second = tl.load(n2_ptr + group, mask=wrow_ok, other=0.0)
        scale = _mul_rn(tl.load(nc_ptr + u), second, EXACT_MUL) + offset
    else:
        scale = tl.load(s_ptr + wr * kb + j, mask=wrow_ok, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    w_hi = _round_to(hi * scale[:, None], dt, EXACT_BF16).to(tl.float32)
    w_lo = _round_to(lo * scale[:, None], dt, EXACT_BF16).to(tl.float32)
    # Exact products (16-bit x 16-bit), float32 sums: an FMA rounds them as mul + add would.
    acc += xe[:, None, :] * w_hi[None, :, :]
    acc += xo[:, None, :] * w_lo[None, :, :]
    return acc


@triton.jit
def _nf4_gemm_kernel(x_ptr, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, y_ptr, p_ptr,
                     M, N, x_stride, y_stride,
                     K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                     NUM_SHARDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCKS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
                     EXACT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr, SILU_MUL: tl.constexpr):
    # Row blocks vary fastest: the programs dequantizing one weight tile run back to back.
    # Program (m, n, s) sums the scale blocks [s * KB / SPLIT_K, (s + 1) * KB / SPLIT_K) of
    # its tile; with SPLIT_K > 1 it writes float32 partial sums ([SPLIT_K, M, N], twice N
    # with SILU_MUL) that ``_split_reduce_kernel`` adds in split order.
    # SILU_MUL: weight rows [0, N) are gate, [N, 2N) up.
    HALF: tl.constexpr = BLOCKSIZE // 2
    (pid_m, pid_n, pid_k, rows, cols, row_ok, col_ok, start, base, offset, start_u, base_u,
     offset_u) = _program_tile(sh_ptr, off_ptr, M, N, NESTED, NUM_SHARDS, BLOCK_M, BLOCK_N,
                               SILU_MUL)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, HALF), dtype=tl.float32)
    acc3_u = tl.zeros((BLOCK_M, BLOCK_N, HALF), dtype=tl.float32)
    per_split: tl.constexpr = K // BLOCKSIZE // SPLIT_K
    j0 = pid_k * per_split
    for jj in range(0, per_split, BLOCKS_PER_ITER):
        for r in tl.static_range(BLOCKS_PER_ITER):
            j = j0 + jj + r
            acc3 = _block_product(acc3, x_ptr, x_stride, rows, row_ok, w_ptr, s_ptr, code_ptr,
                                  n2_ptr, nc_ptr, cols, col_ok, start, base, offset, j,
                                  K, BLOCKSIZE, NESTED, EXACT_BF16, EXACT_MUL)
            if SILU_MUL:
                acc3_u = _block_product(acc3_u, x_ptr, x_stride, rows, row_ok, w_ptr, s_ptr,
                                        code_ptr, n2_ptr, nc_ptr, cols + N, col_ok, start_u,
                                        base_u, offset_u, j, K, BLOCKSIZE, NESTED, EXACT_BF16,
                                        EXACT_MUL)
    _store_output(tl.sum(acc3, axis=2), tl.sum(acc3_u, axis=2), y_ptr, p_ptr, rows, cols, row_ok,
                  col_ok, M, N, y_stride, pid_k, x_ptr.dtype.element_ty, SPLIT_K, SILU_MUL)


@triton.jit
def _program_tile(sh_ptr, off_ptr, M, N, NESTED: tl.constexpr, NUM_SHARDS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):
    # Program (m, n, s) of either GEMM: its rows and weight rows, their masks, and with
    # NESTED each weight row's shard (first row, first second-level scale, offset), for up's
    # rows too with SILU_MUL.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.zeros_like(cols)
    base = tl.zeros_like(cols)
    offset = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start_u = start
    base_u = base
    offset_u = offset
    if NESTED:
        start, base, offset = _shard_of(sh_ptr, off_ptr, cols, NUM_SHARDS)
        if SILU_MUL:
            start_u, base_u, offset_u = _shard_of(sh_ptr, off_ptr, cols + N, NUM_SHARDS)
    return (pid_m, pid_n, pid_k, rows, cols, rows < M, cols < N, start, base, offset, start_u,
            base_u, offset_u)


@triton.jit
def _store_output(acc, acc_u, y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N, y_stride, pid_k,
                  dt: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr):
    # Without a K split: the epilogue and the output. With one: the float32 partial sums
    # ([SPLIT_K, M, N], twice N with SILU_MUL) for ``_split_reduce_kernel``.
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        y = _epilogue(acc, acc_u, dt, y_ptr.dtype.element_ty, SILU_MUL)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * y_stride + cols[None, :], y, mask=mask)
    else:
        width = 2 * N if SILU_MUL else N
        p_ptrs = p_ptr + (pid_k * M + rows.to(tl.int64))[:, None] * width + cols[None, :]
        tl.store(p_ptrs, acc, mask=mask)
        if SILU_MUL:
            tl.store(p_ptrs + N, acc_u, mask=mask)


def _nibble_lookup_ptx(
    halves: list[tuple[tuple[str, ...], list[tuple[str, str]]]], word: str = "$4"
) -> str:
    """The PTX of eight 4-bit lookups into a 16-entry table of 16-bit values held as byte
    planes (``word`` the packed word): per half word, the table operands (low-byte words of
    entries 0-3, 4-7, 8-11, 12-15, then the high-byte ones) and the outputs with the byte
    selectors that interleave the two planes into them."""
    lines = [
        ".reg .b32 s, q, a, b, l, h;",
        f"and.b32 s, {word}, 0x77777777;",
        f"shr.b32 q, {word}, 1;",
        "and.b32 q, q, 0x44444444;",
        "or.b32 q, q, 0x32103210;",
    ]
    for i, (t, outs) in enumerate(halves):
        if i:
            lines += ["shr.b32 s, s, 16;", "shr.b32 q, q, 16;"]
        lines += [
            f"prmt.b32 a, {t[0]}, {t[1]}, s;",
            f"prmt.b32 b, {t[2]}, {t[3]}, s;",
            "prmt.b32 l, a, b, q;",
            f"prmt.b32 a, {t[4]}, {t[5]}, s;",
            f"prmt.b32 b, {t[6]}, {t[7]}, s;",
            "prmt.b32 h, a, b, q;",
        ]
        lines += [f"prmt.b32 {out}, l, h, {sel};" for out, sel in outs]
    return "{\n" + "\n".join(lines) + "\n}"


# The 16 dequantized values of one scale block, as four 32-bit words of their low bytes and four
# of their high bytes (entry 4q + r in byte r of word q), are a lookup table that byte permutes
# (prmt) index directly: a 16-bit selector of four 4-bit indices picks four bytes out of two
# words. Per 32-bit word of packed weight (8 values): the indices' low 3 bits select within
# entries 0-7 and 8-15 of each plane, a second permute takes each byte from one or the other by
# the index's bit 3 (nibble j of that selector: j, plus 4 where bit 3 is set), and two more
# interleave the planes into the even (high-nibble) and odd (low-nibble) values. Operands: $0 $1
# even values, $2 $3 odd, $4 four packed bytes, then each table word four times (once per byte);
# bytes 0-1 read the table of byte 0 and bytes 2-3 that of byte 2 (a thread's consecutive
# bytes of one scale block: the kernel's tiles are whole blocks).
_LUT_PTX = tl.constexpr(_nibble_lookup_ptx([
    (("$5", "$9", "$13", "$17", "$21", "$25", "$29", "$33"), [("$0", "0x7351"), ("$2", "0x6240")]),
    (("$7", "$11", "$15", "$19", "$23", "$27", "$31", "$35"), [("$1", "0x7351"), ("$3", "0x6240")]),
]))

# Four output registers, the packed bytes, then 8 table words x 4 elements.
_LUT_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 33))


@triton.jit
def _table_word(code_ptr, scale, q: tl.constexpr, dt: tl.constexpr, EXACT_BF16: tl.constexpr):
    # Word q of the table of blocks with float32 scales ``scale`` ([BLOCK_N, NB]): entries
    # 4q .. 4q + 3, their low bytes and their high bytes, each [BLOCK_N, NB]. Entry by entry,
    # so that every step is elementwise on the scales' layout.
    lo = tl.zeros_like(scale).to(tl.uint32)
    hi = tl.zeros_like(scale).to(tl.uint32)
    for r in tl.static_range(4):
        v = _round_to(tl.load(code_ptr + 4 * q + r) * scale, dt, EXACT_BF16)
        bits = v.to(tl.uint16, bitcast=True).to(tl.uint32)
        lo |= (bits & 0xFF) << (8 * r)
        hi |= (bits >> 8) << (8 * r)
    return lo, hi


@triton.jit
def _table_value(l0, l1, l2, l3, h0, h1, h2, h3, idx, dt: tl.constexpr):
    # The interpreter's form of the permutes: entry ``idx`` of the table, as ``dt``.
    q = idx >> 2
    sh = ((idx & 3) * 8).to(tl.uint32)
    lw = tl.where(q == 0, l0, tl.where(q == 1, l1, tl.where(q == 2, l2, l3)))
    hw = tl.where(q == 0, h0, tl.where(q == 1, h1, tl.where(q == 2, h2, h3)))
    bits = ((lw >> sh) & 0xFF) | (((hw >> sh) & 0xFF) << 8)
    return bits.to(tl.uint16).to(dt, bitcast=True)


@triton.jit
def _table_product(acc, x_ptr, x_stride, rows, row_ok, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr,
                   wrows, wrow_ok, start, base, offset, j0,
                   K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                   NB: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                   EXACT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr, PTX: tl.constexpr):
    # acc ([BLOCK_M, BLOCK_N]) += x[rows, blocks j0 .. j0 + NB) @ W[wrows, same columns]^T on
    # the tensor cores, the weight tile looked up in each block's table of its 16 values
    # (``dequantize_4bit``'s values: code x scale in float32, rounded once). Even elements
    # (high nibbles) and odd ones (low nibbles) are two dots against the matching columns of
    # x, split from one contiguous load.
    HALF: tl.constexpr = BLOCKSIZE // 2
    kb: tl.constexpr = K // BLOCKSIZE
    dt = x_ptr.dtype.element_ty
    j = j0 + tl.arange(0, NB)
    wr = wrows.to(tl.int64)
    sidx = wr[:, None] * kb + j[None, :]
    if NESTED:
        u = tl.load(s_ptr + sidx, mask=wrow_ok[:, None], other=0).to(tl.int32)
        group = base.to(tl.int64)[:, None] + ((wrows - start).to(tl.int64)[:, None] * kb
                                              + j[None, :]) // 256
        second = tl.load(n2_ptr + group, mask=wrow_ok[:, None], other=0.0)
        scale = _mul_rn(tl.load(nc_ptr + u), second, EXACT_MUL) + offset[:, None]
    else:
        scale = tl.load(s_ptr + sidx, mask=wrow_ok[:, None], other=0.0).to(tl.float32)
    l0, h0 = _table_word(code_ptr, scale, 0, dt, EXACT_BF16)
    l1, h1 = _table_word(code_ptr, scale, 1, dt, EXACT_BF16)
    l2, h2 = _table_word(code_ptr, scale, 2, dt, EXACT_BF16)
    l3, h3 = _table_word(code_ptr, scale, 3, dt, EXACT_BF16)
    half = tl.arange(0, HALF)
    b = tl.load(w_ptr + wr[:, None, None] * (K // 2) + (j * HALF)[None, :, None]
                + half[None, None, :], mask=wrow_ok[:, None, None], other=0)
    if PTX:
        even, odd = tl.inline_asm_elementwise(
            _LUT_PTX, _LUT_CONSTRAINTS,
            [b, l0[:, :, None], l1[:, :, None], l2[:, :, None], l3[:, :, None],
             h0[:, :, None], h1[:, :, None], h2[:, :, None], h3[:, :, None]],
            dtype=(dt, dt), is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        l0, l1, l2, l3 = l0[:, :, None], l1[:, :, None], l2[:, :, None], l3[:, :, None]
        h0, h1, h2, h3 = h0[:, :, None], h1[:, :, None], h2[:, :, None], h3[:, :, None]
        even = _table_value(l0, l1, l2, l3, h0, h1, h2, h3, bi >> 4, dt)
        odd = _table_value(l0, l1, l2, l3, h0, h1, h2, h3, bi & 15, dt)
    TK: tl.constexpr = NB * HALF
    even = tl.reshape(even, (BLOCK_N, TK))
    odd = tl.reshape(odd, (BLOCK_N, TK))
    t = tl.arange(0, 2 * TK)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_stride + (j0 * BLOCKSIZE + t)[None, :]
    xe, xo = tl.split(tl.reshape(tl.load(x_ptrs, mask=row_ok[:, None], other=0.0),
                                 (x_ptrs.shape[0], TK, 2)))
    if DOT_F32:  # exact products either way; the interpreter's 16-bit dot is unreliable
        acc = tl.dot(xe.to(tl.float32), tl.trans(even.to(tl.float32)), acc, input_precision="ieee")
        acc = tl.dot(xo.to(tl.float32), tl.trans(odd.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(xe, tl.trans(even), acc)
        acc = tl.dot(xo, tl.trans(odd), acc)
    return acc


@triton.jit
def _nf4_table_kernel(x_ptr, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, y_ptr,
                      p_ptr, M, N, x_stride, y_stride,
                      K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                      NUM_SHARDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCKS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
                      DOT_F32: tl.constexpr, EXACT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr,
                      SILU_MUL: tl.constexpr, PTX: tl.constexpr):
    # The tensor-core GEMM on table lookups (``_table_product``); a decode step's few rows are
    # padded to the dot's 16. Grid, K split and partial sums as ``_nf4_gemm_kernel``.
    (pid_m, pid_n, pid_k, rows, cols, row_ok, col_ok, start, base, offset, start_u, base_u,
     offset_u) = _program_tile(sh_ptr, off_ptr, M, N, NESTED, NUM_SHARDS, BLOCK_M, BLOCK_N,
                               SILU_MUL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    per_split: tl.constexpr = K // BLOCKSIZE // SPLIT_K
    for jj in range(0, per_split, BLOCKS_PER_ITER):
        j0 = pid_k * per_split + jj
        acc = _table_product(acc, x_ptr, x_stride, rows, row_ok, w_ptr, s_ptr, code_ptr,
                             n2_ptr, nc_ptr, cols, col_ok, start, base, offset, j0,
                             K, BLOCKSIZE, NESTED, BLOCKS_PER_ITER, BLOCK_N, DOT_F32,
                             EXACT_BF16, EXACT_MUL, PTX)
        if SILU_MUL:
            acc_u = _table_product(acc_u, x_ptr, x_stride, rows, row_ok, w_ptr, s_ptr,
                                   code_ptr, n2_ptr, nc_ptr, cols + N, col_ok, start_u, base_u,
                                   offset_u, j0, K, BLOCKSIZE, NESTED, BLOCKS_PER_ITER,
                                   BLOCK_N, DOT_F32, EXACT_BF16, EXACT_MUL, PTX)
    _store_output(acc, acc_u, y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N, y_stride, pid_k,
                  x_ptr.dtype.element_ty, SPLIT_K, SILU_MUL)


# The pair kernel: CUDA-core GEMV on per-block tables, looked-up values as bf16 pairs.

_PAIR_TABLE = ("$5", "$6", "$7", "$8", "$9", "$10", "$11", "$12")
_PAIR_PTX = tl.constexpr(_nibble_lookup_ptx([
    (_PAIR_TABLE, [("$0", "0x4051"), ("$1", "0x6273")]),
    (_PAIR_TABLE, [("$2", "0x4051"), ("$3", "0x6273")]),
]))
_PAIR_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 9))


# Four entries of a block's table from their float32 values: each rounded to the activation
# dtype (two per conversion), then their low bytes into one word and their high bytes into
# another (entry r in byte r), the layout ``_PAIR_PTX`` indexes.
_TABLE_PTX_BF16 = tl.constexpr("""{
.reg .b32 a, b;
cvt.rn.bf16x2.f32 a, $3, $2;
cvt.rn.bf16x2.f32 b, $5, $4;
prmt.b32 $0, a, b, 0x6420;
prmt.b32 $1, a, b, 0x7531;
}""")
_TABLE_PTX_F16 = tl.constexpr("""{
.reg .b32 a, b;
cvt.rn.f16x2.f32 a, $3, $2;
cvt.rn.f16x2.f32 b, $5, $4;
prmt.b32 $0, a, b, 0x6420;
prmt.b32 $1, a, b, 0x7531;
}""")


@triton.jit
def _table_words(code_ptr, scale, q: tl.constexpr, dt: tl.constexpr, EXACT_BF16: tl.constexpr,
                 PTX: tl.constexpr):
    # ``_table_word``: word q of the table (entries 4q .. 4q + 3), low and high bytes.
    if PTX:
        v0 = tl.load(code_ptr + 4 * q) * scale
        v1 = tl.load(code_ptr + 4 * q + 1) * scale
        v2 = tl.load(code_ptr + 4 * q + 2) * scale
        v3 = tl.load(code_ptr + 4 * q + 3) * scale
        asm: tl.constexpr = _TABLE_PTX_BF16 if dt == tl.bfloat16 else _TABLE_PTX_F16
        lo, hi = tl.inline_asm_elementwise(asm, "=r,=r,f,f,f,f", [v0, v1, v2, v3],
                                           dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        lo, hi = _table_word(code_ptr, scale, q, dt, EXACT_BF16)
    return lo, hi


@triton.jit
def _table_bits(l0, l1, l2, l3, h0, h1, h2, h3, idx):
    # The interpreter's form of one lookup: entry ``idx`` of the table, its 16 bits.
    q = idx >> 2
    sh = (idx & 3) * 8
    lw = tl.where(q == 0, l0, tl.where(q == 1, l1, tl.where(q == 2, l2, l3)))
    hw = tl.where(q == 0, h0, tl.where(q == 1, h1, tl.where(q == 2, h2, h3)))
    return ((lw >> sh) & 0xFF) | (((hw >> sh) & 0xFF) << 8)


@triton.jit
def _pair(l0, l1, l2, l3, h0, h1, h2, h3, word, k: tl.constexpr):
    # The interpreter's form of ``_PAIR_PTX``: elements 2k (the high nibble of byte k) and
    # 2k + 1 (its low nibble) of a packed word, looked up: the first in the low half of the
    # result, the second in the high half. Both lookups in one (the interpreter pays per call).
    idx = tl.join((word >> (8 * k + 4)) & 15, (word >> (8 * k)) & 15)
    even, odd = tl.split(_table_bits(l0[:, :, None], l1[:, :, None], l2[:, :, None],
                                     l3[:, :, None], h0[:, :, None], h1[:, :, None],
                                     h2[:, :, None], h3[:, :, None], idx))
    return even | (odd << 16)


@triton.jit
def _pair_fetch(w_ptr, s_ptr, n2_ptr, nc_ptr, wrows, start, base, j,
                K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr):
    # The memory reads of block j of weight rows ``wrows``: its code (nested: the dynamic
    # table's value for the row's index) and second-level scale ([BLOCK_N] float32 each; the
    # scale and 1 without nesting) and, for blocks of 64, its eight packed words as two
    # [BLOCK_N, 4] loads (larger blocks read theirs in ``_pair_block``).
    kb: tl.constexpr = K // BLOCKSIZE
    wr = wrows.to(tl.int64)
    if NESTED:
        u = tl.load(s_ptr + wr * kb + j).to(tl.int32)
        group = base.to(tl.int64) + ((wrows - start).to(tl.int64) * kb + j) // 256
        code = tl.load(nc_ptr + u)
        second = tl.load(n2_ptr + group)
    else:
        code = tl.load(s_ptr + wr * kb + j).to(tl.float32)
        second = tl.full(code.shape, 1.0, tl.float32)
    w32 = w_ptr.to(tl.pointer_type(tl.uint32)) + wr[:, None] * (K // 8)
    words = j * (BLOCKSIZE // 8) + tl.arange(0, 4)[None, :]
    if BLOCKSIZE == 64:
        wa = tl.load(w32 + words)
        wb = tl.load(w32 + words + 4)
    else:
        wa = tl.zeros((wrows.shape[0], 4), dtype=tl.uint32)
        wb = wa
    return code, second, wa, wb


@triton.jit
def _pair_block(a0, a1, a2, a3, x_ptr, r0, r1, r2, r3, w_ptr, code_ptr, wrows, offset, j,
                code, second, wa, wb,
                K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                BLOCK_M: tl.constexpr, EXACT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr,
                PTX: tl.constexpr):
    # a_m ([BLOCK_N, 4] float32 sums, reduced after the K loop) += x[row m, block j] *
    # W[wrows, block j] for each of the BLOCK_M rows (x's row offsets r0 .. r3), from the
    # block's reads (``_pair_fetch``). The block's table is built once per weight row; its
    # packed words come four at a time (16 bytes, one weight row a thread), each word looked
    # up as four 16-bit pairs (``_PAIR_PTX``) that meet the matching pairs of x on the CUDA
    # cores.
    dt = x_ptr.dtype.element_ty
    if NESTED:
        scale = _mul_rn(code, second, EXACT_MUL) + offset
    else:
        scale = code
    l0, h0 = _table_words(code_ptr, scale, 0, dt, EXACT_BF16, PTX)
    l1, h1 = _table_words(code_ptr, scale, 1, dt, EXACT_BF16, PTX)
    l2, h2 = _table_words(code_ptr, scale, 2, dt, EXACT_BF16, PTX)
    l3, h3 = _table_words(code_ptr, scale, 3, dt, EXACT_BF16, PTX)
    l0, l1, l2, l3 = l0[:, None], l1[:, None], l2[:, None], l3[:, None]
    h0, h1, h2, h3 = h0[:, None], h1[:, None], h2[:, None], h3[:, None]
    w32 = w_ptr.to(tl.pointer_type(tl.uint32)) + wrows.to(tl.int64)[:, None] * (K // 8)
    four = tl.arange(0, 4)
    for q in tl.static_range(BLOCKSIZE // 32):
        w0 = j * (BLOCKSIZE // 8) + 4 * q  # the first of these four words, within the row
        if BLOCKSIZE == 64:
            word = wa if q == 0 else wb
        else:
            word = tl.load(w32 + (w0 + four)[None, :])
        if PTX:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _PAIR_PTX, _PAIR_CONSTRAINTS, [word, l0, l1, l2, l3, h0, h1, h2, h3],
                dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
        else:
            p0 = _pair(l0, l1, l2, l3, h0, h1, h2, h3, word, 0)
            p1 = _pair(l0, l1, l2, l3, h0, h1, h2, h3, word, 1)
            p2 = _pair(l0, l1, l2, l3, h0, h1, h2, h3, word, 2)
            p3 = _pair(l0, l1, l2, l3, h0, h1, h2, h3, word, 3)
        a0 = _pair_row(a0, x_ptr, r0, w0, p0, p1, p2, p3)
        if BLOCK_M > 1:
            a1 = _pair_row(a1, x_ptr, r1, w0, p0, p1, p2, p3)
        if BLOCK_M > 2:
            a2 = _pair_row(a2, x_ptr, r2, w0, p0, p1, p2, p3)
            a3 = _pair_row(a3, x_ptr, r3, w0, p0, p1, p2, p3)
    return a0, a1, a2, a3


@triton.jit
def _pair_row(acc, x_ptr, row, w0, p0, p1, p2, p3):
    # acc [BLOCK_N, 4] += x's row (its offset in 32-bit pairs) against four looked-up words
    # from word w0 on: each pair of x meets the matching pair of the weight (16-bit x 16-bit:
    # exact float32 products).
    dt = x_ptr.dtype.element_ty
    xw = x_ptr.to(tl.pointer_type(tl.uint32)) + row + 4 * (w0 + tl.arange(0, 4))[None, :]
    acc = _pair_fma(acc, tl.load(xw), p0, dt)
    acc = _pair_fma(acc, tl.load(xw + 1), p1, dt)
    acc = _pair_fma(acc, tl.load(xw + 2), p2, dt)
    acc = _pair_fma(acc, tl.load(xw + 3), p3, dt)
    return acc


@triton.jit
def _pair_fma(acc, xp, wp, dt: tl.constexpr):
    # acc += both products of a pair of x with a pair of the weight, the 16-bit halves widened
    # to float32 exactly (bfloat16 by moving its bits).
    if dt == tl.bfloat16:
        acc += (xp << 16).to(tl.float32, bitcast=True) * (wp << 16).to(tl.float32, bitcast=True)
        acc += (xp & 0xFFFF0000).to(tl.float32, bitcast=True) * (
            (wp & 0xFFFF0000).to(tl.float32, bitcast=True))
    else:
        acc += (xp & 0xFFFF).to(tl.uint16).to(dt, bitcast=True).to(tl.float32) * (
            (wp & 0xFFFF).to(tl.uint16).to(dt, bitcast=True).to(tl.float32))
        acc += (xp >> 16).to(tl.uint16).to(dt, bitcast=True).to(tl.float32) * (
            (wp >> 16).to(tl.uint16).to(dt, bitcast=True).to(tl.float32))
    return acc


@triton.jit
def _pair_sums(a0, a1, a2, a3, BLOCK_M: tl.constexpr):
    # The accumulators' row sums as one [BLOCK_M, BLOCK_N] tile.
    y = tl.sum(a0, axis=1)[None, :]
    if BLOCK_M > 1:
        y = tl.join(y, tl.sum(a1, axis=1)[None, :])  # [1, BLOCK_N, 2]
        y = tl.reshape(tl.trans(y, (0, 2, 1)), (2, y.shape[1]))
    if BLOCK_M > 2:
        z = tl.join(tl.sum(a2, axis=1)[None, :], tl.sum(a3, axis=1)[None, :])
        z = tl.reshape(tl.trans(z, (0, 2, 1)), (2, z.shape[1]))
        y = tl.reshape(tl.trans(tl.join(y, z), (2, 0, 1)), (4, y.shape[1]))
    return y


@triton.jit
def _nf4_pair_kernel(x_ptr, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, y_ptr, p_ptr,
                     M, N, x_stride, y_stride,
                     K: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                     NUM_SHARDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCKS_PER_ITER: tl.constexpr, SPLIT_K: tl.constexpr,
                     EXACT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr, SILU_MUL: tl.constexpr,
                     PTX: tl.constexpr):
    # The CUDA-core GEMM on table lookups (``_pair_block``) for 1, 2 or 4 rows: every
    # operand is loaded in the layout it is used in, so nothing moves between threads in the
    # K loop. Grid, K split and partial sums as ``_nf4_gemm_kernel``.
    (pid_m, pid_n, pid_k, rows, cols, row_ok, col_ok, start, base, offset, start_u, base_u,
     offset_u) = _program_tile(sh_ptr, off_ptr, M, N, NESTED, NUM_SHARDS, BLOCK_M, BLOCK_N,
                               SILU_MUL)
    dt = x_ptr.dtype.element_ty
    # Rows past M read row M - 1 and weight rows past N the last one; their sums are dropped.
    r0 = tl.minimum(pid_m * BLOCK_M, M - 1).to(tl.int64) * (x_stride // 2)
    r1 = tl.minimum(pid_m * BLOCK_M + 1, M - 1).to(tl.int64) * (x_stride // 2)
    r2 = tl.minimum(pid_m * BLOCK_M + 2, M - 1).to(tl.int64) * (x_stride // 2)
    r3 = tl.minimum(pid_m * BLOCK_M + 3, M - 1).to(tl.int64) * (x_stride // 2)
    wcols = tl.minimum(cols, N - 1)
    a0 = tl.zeros((BLOCK_N, 4), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    u0 = a0
    u1 = a0
    u2 = a0
    u3 = a0
    per_split: tl.constexpr = K // BLOCKSIZE // SPLIT_K
    j0 = pid_k * per_split
    for jj in range(0, per_split, BLOCKS_PER_ITER):
        for r in tl.static_range(BLOCKS_PER_ITER):
            j = j0 + jj + r
            c, sec, wa, wb = _pair_fetch(w_ptr, s_ptr, n2_ptr, nc_ptr, wcols, start, base, j, K,
                                         BLOCKSIZE, NESTED)
            a0, a1, a2, a3 = _pair_block(a0, a1, a2, a3, x_ptr, r0, r1, r2, r3, w_ptr, code_ptr,
                                         wcols, offset, j, c, sec, wa, wb, K, BLOCKSIZE, NESTED,
                                         BLOCK_M, EXACT_BF16, EXACT_MUL, PTX)
            if SILU_MUL:
                c, sec, wa, wb = _pair_fetch(w_ptr, s_ptr, n2_ptr, nc_ptr, wcols + N, start_u,
                                             base_u, j, K, BLOCKSIZE, NESTED)
                u0, u1, u2, u3 = _pair_block(u0, u1, u2, u3, x_ptr, r0, r1, r2, r3, w_ptr,
                                             code_ptr, wcols + N, offset_u, j, c, sec, wa, wb,
                                             K, BLOCKSIZE, NESTED, BLOCK_M, EXACT_BF16,
                                             EXACT_MUL, PTX)
    _store_output(_pair_sums(a0, a1, a2, a3, BLOCK_M), _pair_sums(u0, u1, u2, u3, BLOCK_M),
                  y_ptr, p_ptr, rows, cols, row_ok, col_ok, M, N, y_stride, pid_k, dt, SPLIT_K,
                  SILU_MUL)


# The mma kernel: the same lookups as the A fragments of m16n8k16 tensor-core products.
#
# Lanes are addressed explicitly: lane l of warp w (element 32w + l of every [LANES, 4]
# tensor, whose four columns are one lane's four consecutive registers: a 16-byte load) is
# lane group g = l / 4, thread t = l % 4 of the fragments. It holds weight rows 16w + g and
# 16w + g + 8 of the tile (the fragments' rows g and g + 8) and x row g of the tile (the B
# fragment's column g); in each iteration of four scale blocks, thread t reads block t of
# both weight rows and of its x row. A product's k slots 2t, 2t + 1, 2t + 8 and 2t + 9 hold
# four consecutive values of block t: which value sits in which slot only has to agree
# between the A and the B fragment, and both are read from the same thread's block. The
# accumulators are the D fragment: column c of lane (g, t) is weight row g (c < 2) or g + 8,
# x row 2t + c % 2.


def _mma_half_ptx(ab: str, sets: int = 1) -> str:
    """The PTX of eight m16n8k16 steps over half a scale block (four packed words of each
    of the lane's two weight rows, 32 values) for ``sets`` sets of 8 x rows (each looked-up
    A fragment meets every set's B fragment): operands first the accumulators out (four a
    set), then the words of weight rows g and g + 8 (four each), their tables (low planes,
    then high: eight each), x's 16 pairs of each set, the accumulators in."""
    n = 4 * sets  # the accumulators' operands
    words_lo, words_hi = n, n + 4
    lo = tuple(f"${i}" for i in range(n + 8, n + 16))
    hi = tuple(f"${i}" for i in range(n + 16, n + 24))
    x0 = n + 24  # set s's pair m is $(x0 + 16 s + m)
    acc_out = [", ".join(f"${4 * st + c}" for c in range(4)) for st in range(sets)]
    acc_in = [", ".join(f"${x0 + 16 * sets + 4 * st + c}" for c in range(4)) for st in range(sets)]
    lines = [".reg .b32 p0, p1, p2, p3, r0, r1, r2, r3;"]
    for i in range(4):
        for table, out, word in ((lo, "p", words_lo + i), (hi, "r", words_hi + i)):
            # The word's four pairs (elements 2k, 2k + 1 of byte k) into out0 .. out3.
            pairs = [(f"{out}{k}", "0x4051" if k % 2 == 0 else "0x6273") for k in range(4)]
            lines.append(_nibble_lookup_ptx([(table, pairs[:2]), (table, pairs[2:])], f"${word}"))
        for half, a in enumerate((("p0", "r0", "p1", "r1"), ("p2", "r2", "p3", "r3"))):
            for st in range(sets):
                b = [f"${x0 + 16 * st + 4 * i + 2 * half + r}" for r in range(2)]
                lines.append(
                    f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 {{{acc_out[st]}}}, "
                    f"{{{', '.join(a)}}}, {{{', '.join(b)}}}, {{{acc_in[st]}}};")
                acc_in[st] = acc_out[st]
    return "{\n" + "\n".join(lines) + "\n}"


_MMA_HALF_BF16 = tl.constexpr(_mma_half_ptx("bf16"))
_MMA_HALF_F16 = tl.constexpr(_mma_half_ptx("f16"))
_MMA_HALF_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 40 + ["f"] * 4))
_MMA_HALF2_BF16 = tl.constexpr(_mma_half_ptx("bf16", 2))
_MMA_HALF2_F16 = tl.constexpr(_mma_half_ptx("f16", 2))
_MMA_HALF2_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 56 + ["f"] * 8))


@triton.jit
def _mma_word(table, q: tl.constexpr):
    # Column q of a [LANES, 4] table plane as [LANES, 1] (the interpreter's form).
    return tl.sum(tl.where(tl.arange(0, 4)[None, :] == q, table, 0), axis=1)[:, None]


@triton.jit
def _mma_values(word, lo, hi, dt: tl.constexpr):
    # The interpreter's form of the lookups: [LANES, 4] packed words against the lane's
    # table ([LANES, 4] low and high planes) -> [LANES, 32] float32 values in order.
    # Element 8i + 2k is the high nibble of byte k of word i, 8i + 2k + 1 its low nibble.
    byte = (word[:, :, None] >> (8 * tl.arange(0, 4)[None, None, :])) & 0xFF  # [L, 4, 4]
    idx = tl.reshape(tl.join(byte >> 4, byte & 15), (word.shape[0], 32))
    v = _table_value(_mma_word(lo, 0), _mma_word(lo, 1), _mma_word(lo, 2), _mma_word(lo, 3),
                     _mma_word(hi, 0), _mma_word(hi, 1), _mma_word(hi, 2), _mma_word(hi, 3),
                     idx, dt)
    return v.to(tl.float32)


@triton.jit
def _mma_lane_sum(w, xv, WARPS: tl.constexpr):
    # The interpreter's form of the products: w and xv [LANES, 32] float32 (lane (g, t)'s
    # values of its weight row and of x row g) -> [LANES, 2]: for lane (g, t) the row's sums
    # with x rows 2t and 2t + 1 over the four threads' blocks.
    w4 = tl.reshape(w, (WARPS, 8, 1, 128))
    x4 = tl.reshape(xv, (WARPS, 1, 8, 128))
    d = tl.sum(w4 * x4, axis=3)  # [WARPS, 8 (weight row g), 8 (x row)]
    return tl.reshape(d, (WARPS * 32, 2))  # x row 2t + c of lane (g, t) at [32w + 4g + t, c]


@triton.jit
def _mma_half_emulated(acc, wl, wh, tl_lo, th_lo, tl_hi, th_hi, x0, x1, x2, x3,
                       dt: tl.constexpr, WARPS: tl.constexpr):
    # The interpreter's form of half a block's products for one set of x rows: acc
    # ([LANES, 4], the D fragment) += the lane's two weight rows' packed words wl, wh (tables
    # tl_* / th_*) against x's 16 pairs x0 - x3, summed over the four threads of each lane
    # group as the products do.
    # x_q's column r is pair 4q + r: [L, r, q % 2, q // 2] -> [L, 16] in pair order.
    xs = tl.join(tl.join(x0, x1), tl.join(x2, x3))
    xs = tl.reshape(tl.permute(xs, (0, 3, 2, 1)), (x0.shape[0], 16))
    if dt == tl.bfloat16:
        xe = (xs << 16).to(tl.float32, bitcast=True)
        xo = (xs & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        xe = (xs & 0xFFFF).to(tl.uint16).to(dt, bitcast=True).to(tl.float32)
        xo = (xs >> 16).to(tl.uint16).to(dt, bitcast=True).to(tl.float32)
    xv = tl.reshape(tl.join(xe, xo), (x0.shape[0], 32))
    d_lo = _mma_lane_sum(_mma_values(wl, tl_lo, th_lo, dt), xv, WARPS)
    d_hi = _mma_lane_sum(_mma_values(wh, tl_hi, th_hi, dt), xv, WARPS)
    return acc + tl.reshape(tl.permute(tl.join(d_lo, d_hi), (0, 2, 1)), (x0.shape[0], 4))


@triton.jit
def _mma_half(acc, acc2, wl, wh, tl_lo, th_lo, tl_hi, th_hi, x0, x1, x2, x3, y0, y1, y2, y3,
              dt: tl.constexpr, WARPS: tl.constexpr, SETS: tl.constexpr, PTX: tl.constexpr):
    # acc ([LANES, 4], the D fragment) += half a scale block of both weight rows against x:
    # wl, wh their packed words, tl_* / th_* their tables, x0 - x3 x's 16 pairs; with SETS 2
    # also acc2 += the same against the second set's pairs y0 - y3.
    if PTX:
        if SETS == 1:
            asm: tl.constexpr = _MMA_HALF_BF16 if dt == tl.bfloat16 else _MMA_HALF_F16
            acc = tl.inline_asm_elementwise(
                asm, _MMA_HALF_CONSTRAINTS,
                [wl, wh, tl_lo, th_lo, tl_hi, th_hi, x0, x1, x2, x3, acc],
                dtype=tl.float32, is_pure=True, pack=4)
        else:
            asm2: tl.constexpr = _MMA_HALF2_BF16 if dt == tl.bfloat16 else _MMA_HALF2_F16
            acc, acc2 = tl.inline_asm_elementwise(
                asm2, _MMA_HALF2_CONSTRAINTS,
                [wl, wh, tl_lo, th_lo, tl_hi, th_hi, x0, x1, x2, x3, y0, y1, y2, y3, acc, acc2],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        acc = _mma_half_emulated(acc, wl, wh, tl_lo, th_lo, tl_hi, th_hi, x0, x1, x2, x3, dt,
                                 WARPS)
        if SETS == 2:
            acc2 = _mma_half_emulated(acc2, wl, wh, tl_lo, th_lo, tl_hi, th_hi, y0, y1, y2, y3,
                                      dt, WARPS)
    return acc, acc2


@triton.jit
def _mma_table(code_ptr, scale, dt: tl.constexpr, EXACT_BF16: tl.constexpr, PTX: tl.constexpr):
    # A lane's table of block scale ``scale`` ([LANES]): [LANES, 4] low and high planes,
    # word q in column q (entries 4q .. 4q + 3), the layout ``_nibble_lookup_ptx`` indexes.
    q4 = 4 * tl.arange(0, 4)[None, :]
    v0 = tl.load(code_ptr + q4) * scale[:, None]
    v1 = tl.load(code_ptr + q4 + 1) * scale[:, None]
    v2 = tl.load(code_ptr + q4 + 2) * scale[:, None]
    v3 = tl.load(code_ptr + q4 + 3) * scale[:, None]
    if PTX:
        asm: tl.constexpr = _TABLE_PTX_BF16 if dt == tl.bfloat16 else _TABLE_PTX_F16
        lo, hi = tl.inline_asm_elementwise(asm, "=r,=r,f,f,f,f", [v0, v1, v2, v3],
                                           dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        b0 = _round_to(v0, dt, EXACT_BF16).to(tl.uint16, bitcast=True).to(tl.uint32)
        b1 = _round_to(v1, dt, EXACT_BF16).to(tl.uint16, bitcast=True).to(tl.uint32)
        b2 = _round_to(v2, dt, EXACT_BF16).to(tl.uint16, bitcast=True).to(tl.uint32)
        b3 = _round_to(v3, dt, EXACT_BF16).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | ((b3 & 0xFF) << 24)
        hi = (b0 >> 8) | ((b1 >> 8) << 8) | ((b2 >> 8) << 16) | ((b3 >> 8) << 24)
    return lo, hi


@triton.jit
def _mma_scale(s_ptr, n2_ptr, nc_ptr, wr, start, base, offset, jb,
               K: tl.constexpr, NESTED: tl.constexpr, EXACT_MUL: tl.constexpr,
               BLOCKSIZE: tl.constexpr = 64):
    # float32 scales of blocks jb of weight rows wr (both [LANES]).
    kb: tl.constexpr = K // BLOCKSIZE
    w64 = wr.to(tl.int64)
    if NESTED:
        u = tl.load(s_ptr + w64 * kb + jb).to(tl.int32)
        group = base.to(tl.int64) + ((wr - start).to(tl.int64) * kb + jb) // 256
        scale = _mul_rn(tl.load(nc_ptr + u), tl.load(n2_ptr + group), EXACT_MUL) + offset
    else:
        scale = tl.load(s_ptr + w64 * kb + jb).to(tl.float32)
    return scale


@triton.jit
def _mma_x(x32, jb, q: tl.constexpr):
    # Pairs 4q .. 4q + 3 of block jb ([LANES]) of the lane's x row: [LANES, 4].
    return tl.load(x32[:, None] + (jb * 32 + 4 * q)[:, None] + tl.arange(0, 4)[None, :])


@triton.jit
def _mma_rows(acc, acc2, x32, x32b, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, r_lo, r_hi,
              st_lo, ba_lo, of_lo, st_hi, ba_hi, of_hi, jb, dt: tl.constexpr,
              K: tl.constexpr, NESTED: tl.constexpr, WARPS: tl.constexpr, SETS: tl.constexpr,
              EXACT_BF16: tl.constexpr, EXACT_MUL: tl.constexpr, PTX: tl.constexpr):
    # acc ([LANES, 4]) += block jb ([LANES]) of the lane's weight rows r_lo and r_hi against
    # the same block of its x row (x32: [LANES] pointers to the row's 32-bit pairs); with
    # SETS 2, acc2 += the same against its row of the second set (x32b).
    four = tl.arange(0, 4)[None, :]
    w32 = w_ptr.to(tl.pointer_type(tl.uint32))
    p_lo = w32 + (r_lo.to(tl.int64) * (K // 8) + jb * 8)[:, None] + four
    p_hi = w32 + (r_hi.to(tl.int64) * (K // 8) + jb * 8)[:, None] + four
    wl0 = tl.load(p_lo)
    wl1 = tl.load(p_lo + 4)
    wh0 = tl.load(p_hi)
    wh1 = tl.load(p_hi + 4)
    x0 = _mma_x(x32, jb, 0)
    x1 = _mma_x(x32, jb, 1)
    x2 = _mma_x(x32, jb, 2)
    x3 = _mma_x(x32, jb, 3)
    x4 = _mma_x(x32, jb, 4)
    x5 = _mma_x(x32, jb, 5)
    x6 = _mma_x(x32, jb, 6)
    x7 = _mma_x(x32, jb, 7)
    y0, y1, y2, y3, y4, y5, y6, y7 = x0, x1, x2, x3, x4, x5, x6, x7
    if SETS == 2:
        y0 = _mma_x(x32b, jb, 0)
        y1 = _mma_x(x32b, jb, 1)
        y2 = _mma_x(x32b, jb, 2)
        y3 = _mma_x(x32b, jb, 3)
        y4 = _mma_x(x32b, jb, 4)
        y5 = _mma_x(x32b, jb, 5)
        y6 = _mma_x(x32b, jb, 6)
        y7 = _mma_x(x32b, jb, 7)
    s_lo = _mma_scale(s_ptr, n2_ptr, nc_ptr, r_lo, st_lo, ba_lo, of_lo, jb, K, NESTED, EXACT_MUL)
    s_hi = _mma_scale(s_ptr, n2_ptr, nc_ptr, r_hi, st_hi, ba_hi, of_hi, jb, K, NESTED, EXACT_MUL)
    tl_lo, th_lo = _mma_table(code_ptr, s_lo, dt, EXACT_BF16, PTX)
    tl_hi, th_hi = _mma_table(code_ptr, s_hi, dt, EXACT_BF16, PTX)
    acc, acc2 = _mma_half(acc, acc2, wl0, wh0, tl_lo, th_lo, tl_hi, th_hi, x0, x1, x2, x3,
                          y0, y1, y2, y3, dt, WARPS, SETS, PTX)
    acc, acc2 = _mma_half(acc, acc2, wl1, wh1, tl_lo, th_lo, tl_hi, th_hi, x4, x5, x6, x7,
                          y4, y5, y6, y7, dt, WARPS, SETS, PTX)
    return acc, acc2


@triton.jit
def _mma_store(acc, acc_u, y_ptr, p_ptr, rows, t, m0, M, N, y_stride, pid_k, dt: tl.constexpr,
               SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr):
    # Column c of lane (g, t): weight row rows + 8 (c // 2), x row m0 + 2t + c % 2: the
    # epilogue and the output, or with a K split the float32 partial sums.
    c = tl.arange(0, 4)[None, :]
    out_rows = rows[:, None] + 8 * (c // 2)
    out_x = m0 + 2 * t[:, None] + c % 2
    mask = (out_rows < N) & (out_x < M)
    if SPLIT_K == 1:
        y = _epilogue(acc, acc_u, dt, y_ptr.dtype.element_ty, SILU_MUL)
        tl.store(y_ptr + out_x.to(tl.int64) * y_stride + out_rows, y, mask=mask)
    else:
        width = 2 * N if SILU_MUL else N
        p_ptrs = p_ptr + (pid_k * M + out_x.to(tl.int64)) * width + out_rows
        tl.store(p_ptrs, acc, mask=mask)
        if SILU_MUL:
            tl.store(p_ptrs + N, acc_u, mask=mask)


@triton.jit
def _nf4_mma_kernel(x_ptr, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr, sh_ptr, off_ptr, y_ptr, p_ptr,
                    M, N, x_stride, y_stride,
                    K: tl.constexpr, NESTED: tl.constexpr, NUM_SHARDS: tl.constexpr,
                    WARPS: tl.constexpr, SPLIT_K: tl.constexpr, EXACT_BF16: tl.constexpr,
                    EXACT_MUL: tl.constexpr, SILU_MUL: tl.constexpr, PTX: tl.constexpr,
                    SETS: tl.constexpr):
    # Program (m, n, s): x rows 8 SETS m .. (rows past M read row M - 1, their sums are
    # dropped; SETS sets of 8, each looked-up weight fragment meeting all of them) against
    # weight rows 16 WARPS n .. (rows past N read the last one), scale blocks
    # [s KB / SPLIT_K, (s + 1) KB / SPLIT_K) four at a time (blocks of 64). Output, K split
    # and partial sums as ``_nf4_gemm_kernel``.
    LANES: tl.constexpr = 32 * WARPS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    dt = x_ptr.dtype.element_ty
    lane = tl.arange(0, LANES)
    g = (lane % 32) // 4
    t = lane % 4
    rows = pid_n * (16 * WARPS) + (lane // 32) * 16 + g  # fragment row g; row g + 8 is rows + 8
    r_lo = tl.minimum(rows, N - 1)
    r_hi = tl.minimum(rows + 8, N - 1)
    st_lo = tl.zeros_like(rows)
    ba_lo = st_lo
    of_lo = tl.zeros((LANES,), dtype=tl.float32)
    st_hi, ba_hi, of_hi = st_lo, ba_lo, of_lo
    su_lo, bu_lo, ou_lo = st_lo, ba_lo, of_lo
    su_hi, bu_hi, ou_hi = st_lo, ba_lo, of_lo
    if NESTED:
        st_lo, ba_lo, of_lo = _shard_of(sh_ptr, off_ptr, r_lo, NUM_SHARDS)
        st_hi, ba_hi, of_hi = _shard_of(sh_ptr, off_ptr, r_hi, NUM_SHARDS)
        if SILU_MUL:
            su_lo, bu_lo, ou_lo = _shard_of(sh_ptr, off_ptr, r_lo + N, NUM_SHARDS)
            su_hi, bu_hi, ou_hi = _shard_of(sh_ptr, off_ptr, r_hi + N, NUM_SHARDS)
    m0 = pid_m * 8 * SETS
    x32 = x_ptr.to(tl.pointer_type(tl.uint32)) + (
        tl.minimum(m0 + g, M - 1).to(tl.int64) * (x_stride // 2))
    x32b = x_ptr.to(tl.pointer_type(tl.uint32)) + (
        tl.minimum(m0 + 8 + g, M - 1).to(tl.int64) * (x_stride // 2))
    acc = tl.zeros((LANES, 4), dtype=tl.float32)
    acc2 = acc
    acc_u = acc
    acc_u2 = acc
    per_split: tl.constexpr = K // 64 // SPLIT_K
    j0 = pid_k * per_split
    for jj in range(0, per_split, 4):
        jb = j0 + jj + t
        acc, acc2 = _mma_rows(acc, acc2, x32, x32b, w_ptr, s_ptr, code_ptr, n2_ptr, nc_ptr,
                              r_lo, r_hi, st_lo, ba_lo, of_lo, st_hi, ba_hi, of_hi, jb, dt, K,
                              NESTED, WARPS, SETS, EXACT_BF16, EXACT_MUL, PTX)
        if SILU_MUL:
            acc_u, acc_u2 = _mma_rows(acc_u, acc_u2, x32, x32b, w_ptr, s_ptr, code_ptr, n2_ptr,
                                      nc_ptr, r_lo + N, r_hi + N, su_lo, bu_lo, ou_lo, su_hi,
                                      bu_hi, ou_hi, jb, dt, K, NESTED, WARPS, SETS, EXACT_BF16,
                                      EXACT_MUL, PTX)
    _mma_store(acc, acc_u, y_ptr, p_ptr, rows, t, m0, M, N, y_stride, pid_k, dt, SPLIT_K,
               SILU_MUL)
    if SETS == 2:
        _mma_store(acc2, acc_u2, y_ptr, p_ptr, rows, t, m0 + 8, M, N, y_stride, pid_k, dt,
                   SPLIT_K, SILU_MUL)


@triton.jit
def _split_reduce_kernel(p_ptr, y_ptr, M, N, y_stride, SPLIT_K: tl.constexpr,
                         SILU_MUL: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):
    # y = epilogue(sum over splits, in split order, of the partial sums).
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    m = (i // N).to(tl.int64)
    n = i % N
    width = 2 * N if SILU_MUL else N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ptrs = p_ptr + (s * M + m) * width + n
        acc += tl.load(ptrs, mask=ok, other=0.0)
        if SILU_MUL:
            acc_u += tl.load(ptrs + N, mask=ok, other=0.0)
    y = _epilogue(acc, acc_u, DT, y_ptr.dtype.element_ty, SILU_MUL)
    tl.store(y_ptr + m * y_stride + n, y, mask=ok)


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
    """One launch shape of the GEMM: row and column tile, scale blocks per loop iteration and
    the K split (programs per tile, summed by a second kernel in split order)."""

    block_m: int
    block_n: int
    blocks_per_iter: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    table: bool = False  # the tensor-core kernel on per-block lookup tables (16-bit inputs)
    pairs: bool = False  # the CUDA-core kernel on the same tables (16-bit inputs, 1-4 rows)
    # The same lookups into inline m16n8k16 tensor-core products (16-bit inputs, blocks of
    # 64): block_m 8 or 16 (one or two sets of 8 x rows on each looked-up weight fragment),
    # blocks_per_iter 4 (one a thread of each lane group), block_n 16 weight rows a warp.
    mma: bool = False

    def fits(self, k: int, blocksize: int) -> bool:
        """Whether K (in blocks of ``blocksize``) divides into this config's loop."""
        return k % blocksize == 0 and (k // blocksize) % (self.split_k * self.blocks_per_iter) == 0

    def serves(self, m: int) -> bool:
        """Whether a launch of ``m`` rows may use this config: the float32 CUDA-core kernel
        holds at most ``MAX_ROWS`` rows a tile, the 16-bit kernels tile any number."""
        return self.table or self.pairs or self.mma or self.block_m <= MAX_ROWS


MAX_ROWS = 8  # the GEMM's row tile holds BLOCK_M x BLOCK_N x blocksize / 2 float32 sums


def heuristic_config(
    m: int, n: int, k: int, blocksize: int = 64, dtype: torch.dtype = torch.bfloat16
) -> Nf4Config | None:
    """The launch shape for ``m`` rows without a tuned entry, or None: dequantize into the
    scratch matrix and run the library GEMM. 16-bit inputs: up to 8 rows in blocks of 64 take
    the mma kernel (64 weight rows a program, K split until there are 384 programs, up to 8),
    as the H100 sweep of the 11B shapes chose it at 1, 4 and 8 rows; one row in other blocks
    the pair kernel (512 weight rows a program, 8 warps, K split until there are 128
    programs, up to 16); more rows the table kernel, as
    the H200 and H100 sweeps chose it (``benchmarks/RESULTS.md``): 16-row tiles of two scale
    blocks a step up to 16 rows, 64-row tiles of one above, 64 weight rows a tile, K split in
    eight where the column tiles are few (64 and under), else in four. float32 inputs take
    the CUDA-core kernel up to 4 rows."""
    blocks = k // blocksize
    if dtype in (torch.bfloat16, torch.float16):
        if m <= 8 and blocksize == 64:
            tiles = -(-n // 64)
            split = 1
            while tiles * split < 384 and split < 8:
                split *= 2
            cfg = Nf4Config(8, 64, 4, split, num_warps=4, mma=True)
        elif m == 1:
            tiles = -(-n // 512)
            split = 1
            while tiles * split < 128 and split < 16:
                split *= 2
            cfg = Nf4Config(1, 512, 1, split, num_warps=8, pairs=True)
        else:
            small = m <= 16
            split = 8 if -(-n // 64) <= 64 else 4
            per_iter = 2 if small and blocksize <= 64 else 1
            cfg = Nf4Config(16 if small else 64, 64, per_iter, split, table=True)
        while not cfg.fits(k, blocksize) and cfg.split_k > 1:
            cfg = replace(cfg, split_k=cfg.split_k // 2)
        if not cfg.fits(k, blocksize):
            cfg = replace(cfg, blocks_per_iter=1)
        return cfg if cfg.fits(k, blocksize) else None
    if m > 4:
        return None
    block_m = 1 << (m - 1).bit_length()  # 1, 2 or 4
    block_n = 64 if m == 1 else 32
    tiles = -(-n // block_n)
    per_iter = 2 if blocks % 2 == 0 else 1
    split = 1
    while tiles * split < 1024 and blocks % (2 * split * per_iter) == 0 and split < 8:
        split *= 2
    return Nf4Config(block_m, block_n, per_iter, split)


TUNED = TunedTables(Path(__file__).with_name("nf4_configs"), Nf4Config)
tuned_table_path = TUNED.path  # a GPU model's table (``benchmarks.kernels nf4 --table``)


def table_key(n: int, k: int, blocksize: int, silu: bool) -> str:
    return f"n={n},k={k},bs={blocksize}" + (",silu" if silu else "")


def decode_config(
    m: int,
    n: int,
    k: int,
    blocksize: int = 64,
    silu: bool = False,
    device_name: str = "",
    dtype: torch.dtype = torch.bfloat16,
) -> Nf4Config | None:
    """What ``m`` rows of ``dtype`` run: the GEMM with this config, or None for the scratch
    path. The tuned table's entry for this GPU and shape (that of the smallest tuned row
    count >= m) where there is one it can run, else ``heuristic_config``."""
    found, cfg = TUNED.lookup(device_name, table_key(n, k, blocksize, silu), m)
    if found and (cfg is None or _runs(cfg, m, k, blocksize, dtype)):
        return cfg
    return heuristic_config(m, n, k, blocksize, dtype)


def _runs(cfg: Nf4Config, m: int, k: int, blocksize: int, dtype: torch.dtype) -> bool:
    sixteen = dtype in (torch.bfloat16, torch.float16)
    return (
        cfg.fits(k, blocksize)
        and cfg.serves(m)
        and (sixteen or not (cfg.table or cfg.pairs or cfg.mma))
    )


def prefill_configs(
    n: int,
    k: int,
    blocksize: int = 64,
    silu: bool = False,
    device_name: str = "",
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[int, Nf4Config | None]]:
    """What row counts outside the decode buckets (prefill chunks, eager) run, as ascending
    (up to this many rows, the GEMM's config or None for the scratch path): this GPU's tuned
    entries for the shape, nothing guessed. ``m`` rows take the first entry with at least
    ``m``; more rows than the last entry take the scratch path, which wins at large row
    counts (``benchmarks/RESULTS.md``). Empty: every row count takes the scratch path."""
    steps = TUNED.entries(device_name, table_key(n, k, blocksize, silu))
    return [
        (rows, cfg if cfg is not None and _runs(cfg, rows, k, blocksize, dtype) else None)
        for rows, cfg in steps
    ]


def _block_k(k: int, preferred: int = 128) -> int:
    """The dequantize kernel's tile width: the largest power of two <= ``preferred`` dividing
    K (K is a multiple of 32 at least: the smallest blocksize)."""
    b = preferred
    while k % b:
        b //= 2
    if b < 16:
        raise ValueError(f"K={k} has no tile width (a multiple of 16 is needed)")
    return b


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
    bk = _block_k(k)
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
    cfg = config or heuristic_config(min(m, 4), n, k, qw.blocksize, x.dtype)
    assert cfg is not None
    if not cfg.fits(k, qw.blocksize):
        raise ValueError(f"K={k} in blocks of {qw.blocksize} does not divide into {cfg}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert y.shape == (m, n) and y.stride(1) == 1
    partial = y  # unused without a K split
    if cfg.split_k > 1:
        width = 2 * n if silu_mul else n
        partial = torch.empty((cfg.split_k, m, width), dtype=torch.float32, device=x.device)
    if not cfg.serves(m):
        raise ValueError(f"{cfg}: at most {MAX_ROWS} rows a tile")
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    if cfg.table:
        _launch_table(x, qw, cfg, grid, y, partial, n, silu_mul)
    elif cfg.pairs:
        _launch_pairs(x, qw, cfg, grid, y, partial, n, silu_mul)
    elif cfg.mma:
        _launch_mma(x, qw, cfg, grid, y, partial, n, silu_mul)
    else:
        _nf4_gemm_kernel[grid](
            x, *_pointers(qw), y, partial,
            m, n, x.stride(0), y.stride(0),
            K=k, BLOCKSIZE=qw.blocksize, NESTED=qw.nested, NUM_SHARDS=_num_shards(qw),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCKS_PER_ITER=cfg.blocks_per_iter,
            SPLIT_K=cfg.split_k, EXACT_BF16=_INTERPRETED, EXACT_MUL=not _INTERPRETED,
            SILU_MUL=silu_mul, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if cfg.split_k > 1:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            partial, y, m, n, y.stride(0),
            SPLIT_K=cfg.split_k, SILU_MUL=silu_mul, BLOCK=block,
            DT=_TL_DTYPES[x.dtype], num_warps=4,
        )  # fmt: skip
    return y


def _launch_table(
    x: torch.Tensor,
    qw: QuantizedWeight,
    cfg: Nf4Config,
    grid: tuple[int, int, int],
    y: torch.Tensor,
    partial: torch.Tensor,
    n: int,
    silu_mul: bool,
) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{cfg}: the table kernel takes 16-bit inputs, not {x.dtype}")
    if min(cfg.block_m, cfg.block_n, cfg.blocks_per_iter * qw.blocksize // 2) < 16:
        raise ValueError(f"{cfg}: the table kernel's tiles are 16 wide and up (tl.dot)")
    _nf4_table_kernel[grid](
        x, *_pointers(qw), y, partial,
        x.shape[0], n, x.stride(0), y.stride(0),
        K=qw.shape[1], BLOCKSIZE=qw.blocksize, NESTED=qw.nested, NUM_SHARDS=_num_shards(qw),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCKS_PER_ITER=cfg.blocks_per_iter,
        SPLIT_K=cfg.split_k, DOT_F32=_INTERPRETED, EXACT_BF16=_INTERPRETED,
        EXACT_MUL=not _INTERPRETED, SILU_MUL=silu_mul, PTX=not _INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _check_16bit_pairs(x: torch.Tensor, cfg: Nf4Config, kernel: str) -> None:
    """The pair and mma kernels read 16-bit x as 32-bit pairs."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{cfg}: the {kernel} kernel takes 16-bit inputs, not {x.dtype}")
    if x.stride(0) % 2 or x.data_ptr() % 4:
        raise ValueError(f"the {kernel} kernel reads x in 32-bit pairs: rows must start 4-aligned")


def _launch_pairs(
    x: torch.Tensor,
    qw: QuantizedWeight,
    cfg: Nf4Config,
    grid: tuple[int, int, int],
    y: torch.Tensor,
    partial: torch.Tensor,
    n: int,
    silu_mul: bool,
) -> None:
    _check_16bit_pairs(x, cfg, "pair")
    if cfg.block_m not in (1, 2, 4) or qw.blocksize % 32:
        raise ValueError(f"{cfg}: the pair kernel runs 1, 2 or 4 rows a tile, blocks of 32k")
    _nf4_pair_kernel[grid](
        x, *_pointers(qw), y, partial,
        x.shape[0], n, x.stride(0), y.stride(0),
        K=qw.shape[1], BLOCKSIZE=qw.blocksize, NESTED=qw.nested, NUM_SHARDS=_num_shards(qw),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCKS_PER_ITER=cfg.blocks_per_iter,
        SPLIT_K=cfg.split_k, EXACT_BF16=_INTERPRETED, EXACT_MUL=not _INTERPRETED,
        SILU_MUL=silu_mul, PTX=not _INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _launch_mma(
    x: torch.Tensor,
    qw: QuantizedWeight,
    cfg: Nf4Config,
    grid: tuple[int, int, int],
    y: torch.Tensor,
    partial: torch.Tensor,
    n: int,
    silu_mul: bool,
) -> None:
    _check_16bit_pairs(x, cfg, "mma")
    if qw.blocksize != 64:
        raise ValueError(f"{cfg}: the mma kernel runs blocks of 64, not {qw.blocksize}")
    if cfg.block_m not in (8, 16) or cfg.blocks_per_iter != 4 or cfg.block_n != 16 * cfg.num_warps:
        raise ValueError(
            f"{cfg}: the mma kernel runs 8 or 16 rows and 4 blocks an iteration on 16 weight "
            "rows a warp"
        )
    _nf4_mma_kernel[grid](
        x, *_pointers(qw), y, partial,
        x.shape[0], n, x.stride(0), y.stride(0),
        K=qw.shape[1], NESTED=qw.nested, NUM_SHARDS=_num_shards(qw), WARPS=cfg.num_warps,
        SPLIT_K=cfg.split_k, EXACT_BF16=_INTERPRETED, EXACT_MUL=not _INTERPRETED,
        SILU_MUL=silu_mul, PTX=not _INTERPRETED, SETS=cfg.block_m // 8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


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
