"""The oracle: attention written as its definition, in float64, for tests and benchmarks only.

Nothing in the engine calls this module. Each function is the textbook formula applied one
sequence (or one query) at a time, with no library attention kernel, no page gathering trick
and no masking shortcut, so a production implementation (Triton on CUDA, SDPA, the CPU
back-end's torch code) compared against it is compared against something independent.
Results are returned in the query's dtype.

Cache layout (one layer's view of the page pool): ``[num_pages, num_kv_heads, page_size,
head_dim]``; ``slot = page * page_size + offset``.
"""

from __future__ import annotations

import torch

from vllm.attention.kv_cache_dtype import to_cache


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one sequence in float64: q [M, Hq, D], k/v [N, Hkv, D]
    (query head h reads KV head h // (Hq / Hkv)); ``visible`` [M, N] bool. A query that sees
    no key gets zeros."""
    m, hq, d = q.shape
    out = torch.zeros(m, hq, d, dtype=torch.float64, device=q.device)
    if k.shape[0] == 0 or m == 0:
        return out
    group = hq // k.shape[1]
    q64, k64, v64 = q.double(), k.double(), v.double()
    for h in range(hq):
        scores = q64[:, h] @ k64[:, h // group].T * scale  # [M, N]
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        seen = torch.isfinite(scores).any(dim=1, keepdim=True)
        weights = torch.softmax(torch.where(seen, scores, torch.zeros_like(scores)), dim=1)
        weights = torch.where(seen, weights, torch.zeros_like(weights))
        out[:, h] = weights @ v64[:, h // group]
    return out


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = padding (writes nothing)
) -> None:
    """Each token's K/V rows into its slot, one token at a time; padding writes nothing."""
    page_size = key_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        page, offset = divmod(slot, page_size)
        key_cache[page, :, offset] = to_cache(key[i], key_cache.dtype)
        value_cache[page, :, offset] = to_cache(value[i], value_cache.dtype)


def _paged_rows(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """The first ``length`` token rows of a sequence's pages: [length, num_kv_heads, D]."""
    page_size = cache.shape[2]
    rows = [cache[table[t // page_size], :, t % page_size] for t in range(length)]
    if not rows:
        return cache.new_zeros(0, cache.shape[1], cache.shape[3])
    return torch.stack(rows)


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32; 0 gives a zero output
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over the first ``seq_lens[b]`` tokens of its pages."""
    out = torch.empty_like(query)
    tables, lens = block_tables.tolist(), seq_lens.tolist()
    for b in range(query.shape[0]):
        k = _paged_rows(key_cache, tables[b], lens[b])
        v = _paged_rows(value_cache, tables[b], lens[b])
        out[b] = _attend(query[b : b + 1], k, v, scale)[0].to(query.dtype)
    return out


def varlen_causal_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention within each of the packed sequences (prompts start at position 0);
    rows after the last sequence are left as zeros."""
    out = torch.zeros_like(query)
    start = 0
    for n in seq_lens:
        end = start + n
        causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        out[start:end] = _attend(
            query[start:end], key[start:end], value[start:end], scale, causal
        ).to(query.dtype)
        start = end
    return out


def chunked_causal_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]: the chunks, packed
    key_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim]
    value_cache: torch.Tensor,
    block_tables: list[list[int]],  # per chunk: its sequence's pages
    context_lens: list[int],  # per chunk: tokens before it (already in the pages)
    seq_lens: list[int],  # per chunk: its tokens (its K/V also in the pages)
    scale: float,
) -> torch.Tensor:
    """Prefill chunks: the i-th query of a chunk after ``c`` cached tokens sees the
    sequence's tokens 0..c+i, all read from the pages."""
    out = torch.zeros_like(query)
    start = 0
    for table, ctx, n in zip(block_tables, context_lens, seq_lens, strict=True):
        k = _paged_rows(key_cache, table, ctx + n)
        v = _paged_rows(value_cache, table, ctx + n)
        pos_q = torch.arange(ctx, ctx + n, device=query.device)[:, None]
        visible = torch.arange(ctx + n, device=query.device)[None, :] <= pos_q
        out[start : start + n] = _attend(query[start : start + n], k, v, scale, visible).to(
            query.dtype
        )
        start += n
    return out


def ranged_cross_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [S, num_kv_heads, head_dim] packed vision tokens of the step
    value: torch.Tensor,
    runs: list[tuple[int, int, int, int]],  # (q0, q1, kv0, kv1): queries q0..q1 see kv0..kv1
    scale: float,
) -> torch.Tensor:
    """Each run of queries attends its own range of vision tokens; queries outside every run,
    or in a run with an empty range, get zeros."""
    out = torch.zeros_like(query)
    for q0, q1, kv0, kv1 in runs:
        if kv1 > kv0 and q1 > q0:
            out[q0:q1] = _attend(query[q0:q1], key[kv0:kv1], value[kv0:kv1], scale).to(query.dtype)
    return out
