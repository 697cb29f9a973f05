"""Triton kernels fusing the decoder's elementwise work (one launch each instead of several).

At batch 1 a decode step is ~5 ms of weight reads; unfused, the norms, activations and RoPE
add about 30 tiny launches per layer, which costs as much again. Each kernel reproduces the
reference numerics of its torch counterpart in ``layernorm.py`` / ``activation.py`` /
``rotary_embedding.py`` (float32 math, rounding where the reference rounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, gate_ptr, mask_ptr, n_cols, x_stride,
                     res_stride, out_stride, mask_stride, eps, HAS_RESIDUAL: tl.constexpr,
                     HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 (long prefills)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_GATE:
        # A gated branch: gate * where(row_mask, x, 0), rounded like the reference's product.
        keep = tl.load(mask_ptr + row * mask_stride) != 0
        g = tl.load(gate_ptr).to(tl.float32)
        x = tl.where(keep, (g * x.to(tl.float32)).to(x.dtype), tl.zeros_like(x))
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # The reference adds in the activation dtype: round the sum before normalising.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, gate: torch.Tensor | None = None,
             row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, H] -> [N, H]. With ``residual`` ([N, H], updated in place to x + residual) the
    norm is taken of the sum (the fused add-and-norm of a decoder block). With ``gate`` ([1])
    and ``row_mask`` ([N, 1] bool), x is first replaced by gate * where(row_mask, x, 0)."""
    n, h = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(h)
    res = residual if residual is not None else x
    has_gate = gate is not None
    mask = row_mask.view(torch.uint8) if has_gate else x
    _rms_norm_kernel[(n,)](x, res, weight, out, gate if has_gate else x, mask, h, x.stride(0),
                           res.stride(0), out.stride(0), mask.stride(0) if has_gate else 0,
                           eps, HAS_RESIDUAL=residual is not None, HAS_GATE=has_gate,
                           BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out


@triton.jit
def _gate_rows_kernel(x_ptr, gate_ptr, mask_ptr, out_ptr, n_cols, x_stride, out_stride,
                      mask_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 (long prefills)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    keep = tl.load(mask_ptr + row * mask_stride) != 0
    g = tl.load(gate_ptr).to(tl.float32)
    y = tl.where(keep, (g * x.to(tl.float32)).to(x.dtype), tl.zeros_like(x))
    tl.store(out_ptr + row * out_stride + cols, y, mask=m)


def gate_rows(x: torch.Tensor, gate: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    """gate * where(row_mask, x, 0) in one launch: x [N, H], gate [1], row_mask [N, 1]."""
    n, h = x.shape
    out = torch.empty_like(x)
    mask = row_mask.view(torch.uint8)
    block = 1024
    _gate_rows_kernel[(n, triton.cdiv(h, block))](x, gate, mask, out, h, x.stride(0),
                                                  out.stride(0), mask.stride(0), BLOCK=block)
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 (long prefills)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2d] (gate | up) -> [N, d]."""
    n, two_d = x.shape
    d = two_d // 2
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(n, triton.cdiv(d, block))](x, out, d, x.stride(0), out.stride(0),
                                                     BLOCK=block)
    return out


@triton.jit
def _rope_heads(ptr, num_heads, cos, sin, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_H: tl.constexpr):
    """Rotates one token's ``num_heads`` contiguous heads at ``ptr`` in place and returns the
    rotated halves ([BLOCK_H, HALF] each, activation dtype; rows past num_heads are zeros), so
    a caller can store them elsewhere too (the fused RoPE + KV-cache write)."""
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    offs = heads[:, None] * HEAD_DIM + d[None, :]
    m = heads[:, None] < num_heads
    x1 = tl.load(ptr + offs, mask=m, other=0.0)
    x2 = tl.load(ptr + offs + HALF, mask=m, other=0.0)
    # The reference casts cos/sin to the activation dtype before multiplying.
    c = cos[None, :].to(x1.dtype).to(tl.float32)
    s = sin[None, :].to(x1.dtype).to(tl.float32)
    y1 = (x1.to(tl.float32) * c - x2.to(tl.float32) * s).to(x1.dtype)
    y2 = (x2.to(tl.float32) * c + x1.to(tl.float32) * s).to(x1.dtype)
    tl.store(ptr + offs, y1, mask=m)
    tl.store(ptr + offs + HALF, y2, mask=m)
    return y1, y2


@triton.jit
def _rope_cos_sin(pos_ptr, tok, cos_ptr, sin_ptr, cache_stride, HALF: tl.constexpr):
    """The cos/sin half-rows of token ``tok``'s position (padding rows, < 0, read position 0)."""
    pos = tl.load(pos_ptr + tok)
    pos = tl.where(pos < 0, 0, pos)  # padding rows: any position, their output is unused
    d = tl.arange(0, HALF)
    return tl.load(cos_ptr + pos * cache_stride + d), tl.load(sin_ptr + pos * cache_stride + d)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_stride, k_stride, cache_stride,
                 num_q_heads, num_k_heads, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # tok * stride can pass 2^31 (long prefills)
    cos, sin = _rope_cos_sin(pos_ptr, tok, cos_ptr, sin_ptr, cache_stride, HALF)
    _rope_heads(q_ptr + tok * q_stride, num_q_heads, cos, sin, HALF, HEAD_DIM, BLOCK_H)
    _rope_heads(k_ptr + tok * k_stride, num_k_heads, cos, sin, HALF, HEAD_DIM, BLOCK_H)


def rotary_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int) -> None:
    """Rotates q [T, Hq*D] and k [T, Hkv*D] in place (rows may be strided views of a fused
    projection). cos/sin caches: [max_position, D] float32 (the two halves are equal)."""
    t = positions.shape[0]
    nq = q.shape[1] // head_dim
    nk = k.shape[1] // head_dim
    _rope_kernel[(t,)](q, k, positions, cos_cache, sin_cache, q.stride(0), k.stride(0),
                       cos_cache.stride(0), nq, nk, HALF=head_dim // 2, HEAD_DIM=head_dim,
                       BLOCK_H=triton.next_power_of_2(max(nq, nk)))


@triton.jit
def _layer_norm_row(xf, m, n_cols, w_ptr, b_ptr, cols, eps):
    """float32 LayerNorm of one row (``m`` masks the columns past ``n_cols``), like
    ``F.layer_norm``'s float32 math; the caller rounds and stores it."""
    mean = tl.sum(xf, axis=0) / n_cols
    diff = tl.where(m, xf - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
    return diff * rstd * w + b


@triton.jit
def _rounded(v, dt: tl.constexpr):
    """float32 ``v`` rounded to ``dt`` and back, in a way the compiler cannot contract with
    a following add: bf16 by integer round-to-nearest-even on the bits (finite values)."""
    if dt == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(dt).to(tl.float32)


@triton.jit
def _add_layer_norm_kernel(x_ptr, d_ptr, g_ptr, w_ptr, b_ptr, sum_ptr, out_ptr, n_cols,
                           x_stride, d_stride, s_stride, o_stride, eps,
                           HAS_DELTA: tl.constexpr, HAS_GATE: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 (long prefills)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * d_stride + cols, mask=m, other=0.0)
        if HAS_GATE:  # rounded like the reference's separate multiply
            df = _rounded(tl.load(g_ptr).to(tl.float32) * d.to(tl.float32), x.dtype)
        else:
            df = d.to(tl.float32)
        x = (x.to(tl.float32) + df).to(x.dtype)
        tl.store(sum_ptr + row * s_stride + cols, x, mask=m)
    y = _layer_norm_row(x.to(tl.float32), m, n_cols, w_ptr, b_ptr, cols, eps)
    tl.store(out_ptr + row * o_stride + cols, y.to(x.dtype), mask=m)


def add_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   delta: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                   norm_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, layer_norm(s)) with s = x + gate * delta (x itself without ``delta``), in one launch.

    x, delta: [..., H] with contiguous rows; gate: [1]. Without a gate ``s`` is rounded exactly
    as ``x + delta`` is in torch; with one, bf16 products are rounded before the add as torch
    rounds them (in float32 the compiler may contract the two into one FMA). The norm is
    float32 math like ``F.layer_norm``. Eager and graph-captured calls run the same kernel.
    ``sum_out`` / ``norm_out`` (optional, [rows, H] with unit column stride) receive s and the
    norm instead of new tensors; the returned tensors are then those, shaped [rows, H]."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    d2 = delta.reshape(-1, h) if delta is not None else x2
    if delta is None:
        s = x2
    else:
        s = torch.empty_like(x2) if sum_out is None else sum_out
    out = torch.empty_like(x2) if norm_out is None else norm_out
    block = triton.next_power_of_2(h)
    _add_layer_norm_kernel[(x2.shape[0],)](
        x2, d2, gate if gate is not None else x2, weight, bias, s, out, h, x2.stride(0),
        d2.stride(0), s.stride(0), out.stride(0), eps, HAS_DELTA=delta is not None,
        HAS_GATE=gate is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    if sum_out is not None or norm_out is not None:
        return s, out
    return s.view(x.shape), out.view(x.shape)


@triton.jit
def _vision_embed_kernel(patch_ptr, pre_ptr, cls_ptr, pos_ptr, one_minus_ptr, gate_ptr,
                         tile_ptr, ar_ptr, w_ptr, b_ptr, out_ptr, n_cols, eps,
                         TILES: tl.constexpr, TOKENS: tl.constexpr, PADDED: tl.constexpr,
                         BLOCK: tl.constexpr):
    # One program per output row (image, tile, token of the padded tile).
    pid = tl.program_id(0)
    token = pid % PADDED
    tile = (pid // PADDED) % TILES
    image = pid // (PADDED * TILES)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    out = out_ptr + pid.to(tl.int64) * n_cols + cols
    if token >= TOKENS:  # padding rows are zeros
        tl.store(out, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=m)
    else:
        dt = out_ptr.dtype.element_ty
        if token == 0:
            x = tl.load(cls_ptr + cols, mask=m, other=0.0)
        else:  # the patch's projection plus its tile's pre-tile embedding, rounded
            row = (image * TILES + tile).to(tl.int64) * (TOKENS - 1) + token - 1
            p = tl.load(patch_ptr + row * n_cols + cols, mask=m, other=0.0).to(tl.float32)
            pre = tl.load(pre_ptr + (image * TILES + tile) * n_cols + cols, mask=m, other=0.0)
            x = (p + pre.to(tl.float32)).to(dt)
        # x + (1 - g) * position, then + g * tile embedding, each product and sum rounded as
        # the reference's separate torch operations round them.
        pos = tl.load(pos_ptr + token * n_cols + cols, mask=m, other=0.0).to(tl.float32)
        a = _rounded(tl.load(one_minus_ptr).to(tl.float32) * pos, dt)
        x = (x.to(tl.float32) + a).to(dt)
        ar = tl.load(ar_ptr + image).to(tl.int64)
        t_off = ar * (TILES * TOKENS * n_cols) + (tile * TOKENS + token) * n_cols
        te = tl.load(tile_ptr + t_off + cols, mask=m, other=0.0).to(tl.float32)
        bt = _rounded(tl.load(gate_ptr).to(tl.float32) * te, dt)
        x = (x.to(tl.float32) + bt).to(dt)
        tl.store(out, _layer_norm_row(x.to(tl.float32), m, n_cols, w_ptr, b_ptr, cols,
                                      eps).to(dt), mask=m)


def vision_embed_norm(patches: torch.Tensor, pre_tile: torch.Tensor, cls: torch.Tensor,
                      position: torch.Tensor, one_minus_gate: torch.Tensor,
                      gate: torch.Tensor, tile_table: torch.Tensor,
                      aspect_ratio_ids: torch.Tensor, norm_weight: torch.Tensor,
                      norm_bias: torch.Tensor, eps: float, padded: int) -> torch.Tensor:
    """The vision tower's embedding stage in one launch: for every tile, the class token then
    the patches (``patches`` [N, T, P - 1, D] plus ``pre_tile`` [N, T, D]), plus
    ``one_minus_gate * position`` ([P, D]) and ``gate * tile_table[aspect_ratio_ids]``
    (the [A, T * P * D] embedding table), layer-normed, padded with zero rows to ``padded``
    tokens: [N, T, padded, D]. Each product and sum is rounded where the separate torch
    operations round (the gated products through integer rounding: written as a float
    conversion, sm_90 code contracted them with the add into one ``fma.rn.bf16``)."""
    n, t, p1, d = patches.shape
    assert patches.is_contiguous() and pre_tile.is_contiguous() and position.is_contiguous()
    assert tile_table.is_contiguous() and tile_table.shape[1] == t * (p1 + 1) * d
    out = torch.empty(n, t, padded, d, dtype=patches.dtype, device=patches.device)
    block = triton.next_power_of_2(d)
    _vision_embed_kernel[(n * t * padded,)](
        patches, pre_tile, cls, position, one_minus_gate, gate, tile_table, aspect_ratio_ids,
        norm_weight, norm_bias, out, d, eps, TILES=t, TOKENS=p1 + 1, PADDED=padded,
        BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out
