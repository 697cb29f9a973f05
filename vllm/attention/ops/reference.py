"""Plain-torch attention: the CPU backend, and the oracle the GPU kernels are tested against.

Cache layout (one layer's view of the page pool): ``[num_pages, num_kv_heads, page_size, head_dim]``
with any strides; ``slot = page * page_size + offset``. Every function is free of host
synchronisation where it may run inside a captured decode step (the cache write and the paged
decode); the prefill functions loop over host lengths and are never captured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Writes K/V rows into their slots; padding rows go to the null page 0, which nobody reads.

    Done without a boolean mask (a host sync) so it also runs inside a captured step.
    """
    page_size = key_cache.shape[2]
    slots = torch.clamp(slot_mapping, min=0)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - pages * page_size
    # A padding slot -1 becomes slot 0: the null page's first row.
    key_cache[pages, :, offsets] = key.to(key_cache.dtype)
    value_cache[pages, :, offsets] = value.to(value_cache.dtype)


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
    """One query token per sequence over its paged K/V, computed in float32."""
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


def varlen_causal_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention within each of the packed sequences (prompts start at position 0)."""
    out = torch.empty_like(query)
    start = 0
    for n in seq_lens:
        end = start + n
        q = query[start:end].transpose(0, 1).unsqueeze(0)
        k = key[start:end].transpose(0, 1).unsqueeze(0)
        v = value[start:end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


def ranged_cross_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [S, num_kv_heads, head_dim] packed vision tokens of the step
    value: torch.Tensor,
    runs: list[tuple[int, int, int, int]],  # (q0, q1, kv0, kv1): queries q0..q1 see kv0..kv1
    scale: float,
) -> torch.Tensor:
    """Cross-attention where each run of queries sees one contiguous range of vision tokens.

    Queries outside every run, or in a run with an empty range, get zeros.
    """
    out = torch.zeros_like(query)
    for q0, q1, kv0, kv1 in runs:
        if kv1 <= kv0 or q1 <= q0:
            continue
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)
        k = key[kv0:kv1].transpose(0, 1).unsqueeze(0)
        v = value[kv0:kv1].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        out[q0:q1] = o[0].transpose(0, 1)
    return out
