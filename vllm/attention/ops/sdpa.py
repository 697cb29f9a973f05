"""Prefill attention through torch's SDPA: the prefill of both back-ends.

On the H200 SDPA's cuDNN back-end beat the Triton prefill kernels written here (8k-token causal
GQA: 0.98 vs 1.35 ms, the causal kernel since removed; 1,024 x 6,404 ranged cross: 0.18 vs
0.31 ms; benchmarks/RESULTS.md), so the CUDA back-end uses it too, except for cross prefills
of few queries over many vision tokens (``triton_prefill.ranged_cross_attention`` with key
splits fills the GPU there). A prefill chunk (a prompt prefilled over several steps) attends to its
own earlier chunks through the paged cache: the step's chunks gather their pages in groups (one
copy per group and layer, ``ContextGroup``) and attend with a bottom-right causal mask (SDPA
with a boolean mask here, chunk by chunk; on CUDA the ranged Triton kernel, one call per group,
each query's keys being the range [its chunk's first key, its position]). Prefill runs
eagerly, never captured: looping over host lengths is fine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm.attention.metadata import ContextGroup


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """[L, Hq, D] x [S, Hkv, D] -> [L, Hq, D] (GQA through ``enable_gqa``)."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Every token row held by ``pages`` ([n] int64) of one layer's cache ([num_pages, Hkv,
    page_size, D]), page after page -> [n * page_size, Hkv, D]."""
    rows = cache.index_select(0, pages)  # [n, Hkv, P, D]
    n, hkv, p, d = rows.shape
    return rows.permute(0, 2, 1, 3).reshape(n * p, hkv, d)


def attend_after_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """[L, Hq, D] queries at the last L positions of the [S, Hkv, D] keys, causal (query i
    sees keys 0..S-L+i: the causal diagonal aligned to the bottom right), into ``out``.
    SDPA with a boolean mask."""
    length, total = q.shape[0], k.shape[0]
    rows = torch.arange(total - length, total, device=q.device)
    visible = torch.arange(total, device=q.device)[None, :] <= rows[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    out.copy_(o[0].transpose(0, 1))


def attend_group_by_chunk(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ContextGroup,
    scale: float,
    out: torch.Tensor,
) -> None:
    """A context group's chunks one by one (``attend_after_context`` on each chunk's slice
    of the gathered keys): the TORCH back-end's (the TRITON one attends a group in one
    call)."""
    for q0, q1, k0, k1 in group.runs:
        attend_after_context(query[q0:q1], k[k0:k1], v[k0:k1], scale, out[q0:q1])


AfterContext = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, ContextGroup, float, torch.Tensor], None
]


def varlen_causal_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    context_lens: list[int] | None = None,
    context_groups: list[ContextGroup] | None = None,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    after_context: AfterContext = attend_group_by_chunk,
) -> torch.Tensor:
    """Causal attention within each packed sequence. A sequence with ``context_lens[i]`` > 0
    is a prefill chunk: its tokens continue ``context_lens[i]`` tokens whose K/V are in its
    pages of ``kv_cache``, where this chunk's K/V were written too (the layer writes before
    it attends), so it attends to all of them. Such chunks are read by ``context_groups``
    (``ContextGroup``): each group's pages are gathered once, then ``after_context`` attends
    the group's queries (``group.runs``) into ``out``. Rows after the last sequence (a padded
    step's) are left unwritten."""
    out = torch.empty_like(query)
    start = 0
    for i, n in enumerate(seq_lens):
        end = start + n
        if not (context_lens and context_lens[i]):
            out[start:end] = _sdpa(query[start:end], key[start:end], value[start:end], scale, True)
        start = end
    for group in context_groups or ():
        assert kv_cache is not None
        # An FP8 cache's rows are widened to the queries' dtype.
        k = gather_pages(kv_cache[0], group.pages).to(query.dtype)
        v = gather_pages(kv_cache[1], group.pages).to(query.dtype)
        after_context(query, k, v, group, scale, out)
    return out


def ranged_cross_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [S, num_kv_heads, head_dim] packed vision tokens of the step
    value: torch.Tensor,
    runs: list[tuple[int, int, int, int]],  # (q0, q1, kv0, kv1): queries q0..q1 see kv0..kv1
    scale: float,
) -> torch.Tensor:
    """Cross-attention where each run of queries sees one contiguous range of vision tokens;
    queries outside every run, or in a run with an empty range, get zeros."""
    out = torch.zeros_like(query)
    for q0, q1, kv0, kv1 in runs:
        if kv1 > kv0 and q1 > q0:
            out[q0:q1] = _sdpa(query[q0:q1], key[kv0:kv1], value[kv0:kv1], scale, False)
    return out
