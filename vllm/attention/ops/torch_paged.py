"""The paged KV write and decode attention in plain torch: the CPU back-end's.

Both run inside the (emulated) decode graph on CPU, so neither synchronises with the host:
no boolean-mask indexing, no ``.item()``. Cache layout as in ``reference.py``.
"""

from __future__ import annotations

import torch

from vllm.attention.kv_cache_dtype import to_cache


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Writes K/V rows into their slots (``to_cache``: an FP8 cache clamps); padding rows go
    to the null page 0, which nobody reads (a masked write would need a host sync)."""
    page_size = key_cache.shape[2]
    slots = torch.clamp(slot_mapping, min=0)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - pages * page_size
    key_cache[pages, :, offsets] = to_cache(key, key_cache.dtype)
    value_cache[pages, :, offsets] = to_cache(value, value_cache.dtype)


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, W] page ids -> [B, num_kv_heads, W * page_size, head_dim]."""
    b, w = block_tables.shape
    # index_select is much faster than advanced indexing on the strided page view.
    pages = cache.index_select(0, block_tables.reshape(-1).long())  # [B * W, Hkv, P, D]
    hkv, p, d = pages.shape[1:]
    pages = pages.view(b, w, hkv, p, d)
    return pages.permute(0, 2, 1, 3, 4).reshape(b, hkv, w * p, d)


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32; 0 gives a zero output
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its whole pages, the tokens past its length masked;
    computed in float32."""
    b, hq, d = query.shape
    keys = _gather_pages(key_cache, block_tables).float()
    values = _gather_pages(value_cache, block_tables).float()
    hkv, length = keys.shape[1], keys.shape[2]
    q = query.float().view(b, hkv, hq // hkv, d)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    positions = torch.arange(length, device=query.device)
    valid = (positions[None, :] < seq_lens[:, None]).view(b, 1, 1, length)
    scores = scores.masked_fill(~valid, float("-inf"))
    # A zero-length KV has every score at -inf: give it zero weights instead of NaN.
    has_kv = valid.any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(has_kv, scores, torch.zeros_like(scores)), dim=-1)
    probs = torch.where(has_kv & valid, probs, torch.zeros_like(probs))
    out = torch.matmul(probs, values)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(query.dtype)
