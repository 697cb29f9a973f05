"""KV-cache write in Triton: one program per token copies its K and V rows into their slot.

``slot = page * page_size + offset`` into a ``[num_pages, num_kv_heads, page_size, head_dim]``
view with any strides (a layer's slice of the page pool). A negative slot (padding) writes
**nothing**: unlike the torch reference, which diverts padding into the null page, no byte of
the cache is touched, so warm-up and capture can run on real caches. Free of host
synchronisation: safe inside a captured decode step.

``rope_and_write_kv_cache`` fuses a self-attention layer's RoPE into the same launch: a decode
step is a CUDA graph of a few hundred tiny kernels, each costing launch time on the host and
the GPU, so dropping one per layer is worth a kernel of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.kv_cache_dtype import fp8_max
from vllm.model_executor.layers.fused_kernels import _rope_cos_sin, _rope_heads


@triton.jit
def _to_cache(x, cache_ptr, FP8_MAX: tl.constexpr):
    """``x`` in the cache's dtype; an FP8 cache (``FP8_MAX`` > 0) clamps to its finite range
    first, as ``kv_cache_dtype.to_cache`` does (NaN stays NaN)."""
    if FP8_MAX > 0:
        x = tl.where(x > FP8_MAX, FP8_MAX, tl.where(x < -FP8_MAX, -FP8_MAX, x))
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kcp,
    stride_kch,
    stride_kct,
    stride_vcp,
    stride_vch,
    stride_vct,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Grid (num_tokens,): token i's [num_kv_heads, head_dim] K and V rows."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + i).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # The slot test is folded into the mask: a padding token loads and stores nothing.
    mask = (slot >= 0) & (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    safe_slot = tl.maximum(slot, 0)
    page = safe_slot // PAGE_SIZE
    offset = safe_slot % PAGE_SIZE
    k = tl.load(key_ptr + i * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(
        value_ptr + i * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    k_dst = key_cache_ptr + page * stride_kcp + offset * stride_kct
    v_dst = value_cache_ptr + page * stride_vcp + offset * stride_vct
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :],
        _to_cache(k, key_cache_ptr, FP8_MAX),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
        _to_cache(v, value_cache_ptr, FP8_MAX),
        mask=mask,
    )


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_tokens: int, num_kv_heads: int, head_dim: int) -> None:
    """The layout both writers assume: equal [pages, Hkv, page_size, D] views with unit last
    stride, and one contiguous int64 slot per token."""
    assert key_cache.shape == value_cache.shape
    assert key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_dim
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    assert slot_mapping.shape == (num_tokens,)
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()


def write_kv_cache(
    key: torch.Tensor,  # [N, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim], any strides
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64, negative = padding (writes nothing)
    *,
    num_warps: int = 4,
) -> None:
    """Writes each token's K/V into its slot; values are cast to the cache dtype (an FP8 one
    clamps first: ``kv_cache_dtype.to_cache``)."""
    n, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape
    _check_cache(key_cache, value_cache, slot_mapping, n, num_kv_heads, head_dim)
    if n == 0:
        return
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    _kv_write_kernel[(n,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=key_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=fp8_max(key_cache.dtype),
        num_warps=num_warps,
    )


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_qn,
    stride_kn,
    stride_vn,
    stride_cos,
    stride_kcp,
    stride_kch,
    stride_kct,
    stride_vcp,
    stride_vch,
    stride_vct,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Grid (num_tokens,): rotates token i's q and k heads in place (the arithmetic of
    ``rotary_inplace``), then writes the rotated k and the v rows into the token's slot."""
    i = tl.program_id(0).to(tl.int64)
    cos, sin = _rope_cos_sin(pos_ptr, i, cos_ptr, sin_ptr, stride_cos, HALF)
    d = tl.arange(0, HALF)
    _rope_heads(q_ptr + i * stride_qn, NUM_Q_HEADS, cos, sin, HALF, HEAD_DIM, BLOCK_QH)
    # k is stored rotated in place as well: prefill attention reads it from the projection.
    k1, k2 = _rope_heads(k_ptr + i * stride_kn, NUM_KV_HEADS, cos, sin, HALF, HEAD_DIM, BLOCK_KH)
    slot = tl.load(slot_mapping_ptr + i).to(tl.int64)
    heads = tl.arange(0, BLOCK_KH)
    # As in ``_kv_write_kernel``: a padding slot is folded into the mask and writes nothing.
    mask = (slot >= 0) & (heads < NUM_KV_HEADS)[:, None]
    safe_slot = tl.maximum(slot, 0)
    page = safe_slot // PAGE_SIZE
    offset = safe_slot % PAGE_SIZE
    k_dst = key_cache_ptr + page * stride_kcp + offset * stride_kct + heads[:, None] * stride_kch
    k_dst += d[None, :]
    tl.store(k_dst, _to_cache(k1, key_cache_ptr, FP8_MAX), mask=mask)
    tl.store(k_dst + HALF, _to_cache(k2, key_cache_ptr, FP8_MAX), mask=mask)
    dv = tl.arange(0, HEAD_DIM)
    v = tl.load(v_ptr + i * stride_vn + heads[:, None] * HEAD_DIM + dv[None, :], mask=mask)
    v_dst = value_cache_ptr + page * stride_vcp + offset * stride_vct + heads[:, None] * stride_vch
    tl.store(v_dst + dv[None, :], _to_cache(v, value_cache_ptr, FP8_MAX), mask=mask)


def _token_rows(x: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    """[T, H * D] or [T, H, D] -> a [T, H * D] view with contiguous heads. ``view`` never
    copies (it raises instead), so the in-place rotation always lands in the caller's tensor."""
    rows = x.view(num_tokens, -1)
    assert rows.stride(1) == 1 and rows.shape[1] % head_dim == 0
    return rows


def rope_and_write_kv_cache(
    positions: torch.Tensor,  # [T] int, negative = padding (rotated as position 0)
    query: torch.Tensor,  # [T, Hq * D] or [T, Hq, D], rows may be strided
    key: torch.Tensor,  # [T, Hkv * D] or [T, Hkv, D], rows may be strided
    value: torch.Tensor,
    cos_cache: torch.Tensor,  # [max_position, D] float32 (the two halves are equal)
    sin_cache: torch.Tensor,
    key_cache: torch.Tensor,  # [num_pages, Hkv, page_size, D], any strides
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, negative = padding (writes nothing)
    *,
    num_warps: int = 4,
) -> None:
    """RoPE on q and k in place, then the K/V-cache write of ``write_kv_cache``, in one launch.

    Bitwise equal to ``rotary_inplace`` followed by ``write_kv_cache`` (q, k and both caches).
    A padding slot skips only the cache write; its q/k rows are still rotated, as before.
    """
    n = positions.shape[0]
    head_dim = key_cache.shape[3]
    q, k, v = (_token_rows(x, n, head_dim) for x in (query, key, value))
    num_q_heads, num_kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    assert v.shape == k.shape
    _check_cache(key_cache, value_cache, slot_mapping, n, num_kv_heads, head_dim)
    assert cos_cache.stride() == sin_cache.stride() and cos_cache.stride(1) == 1
    if n == 0:
        return
    _rope_kv_write_kernel[(n,)](
        q, k, v, positions, cos_cache, sin_cache, key_cache, value_cache, slot_mapping,
        q.stride(0), k.stride(0), v.stride(0), cos_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        HEAD_DIM=head_dim,
        PAGE_SIZE=key_cache.shape[2],
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        FP8_MAX=fp8_max(key_cache.dtype),
        num_warps=num_warps,
    )
