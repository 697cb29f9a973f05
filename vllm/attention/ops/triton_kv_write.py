"""KV-cache write in Triton: one program per token copies its K and V rows into their slot.

``slot = page * page_size + offset`` into a ``[num_pages, num_kv_heads, page_size, head_dim]``
view with any strides (a layer's slice of the page pool). A negative slot (padding) writes
**nothing**: unlike the torch reference, which diverts padding into the null page, no byte of
the cache is touched, so warm-up and capture can run on real caches. Free of host
synchronisation: safe inside a captured decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache(
    key: torch.Tensor,  # [N, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim], any strides
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int64, negative = padding (writes nothing)
    *,
    num_warps: int = 4,
) -> None:
    """Writes each token's K/V into its slot; values are cast to the cache dtype."""
    n, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (n,)
    assert key_cache.shape == value_cache.shape
    assert key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_dim
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
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
        num_warps=num_warps,
    )
