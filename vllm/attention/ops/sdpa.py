"""Prefill attention through torch's SDPA: the prefill of both back-ends.

On the H200 SDPA's cuDNN back-end beat the Triton prefill kernels written here (8k-token causal
GQA: 0.98 vs 1.35 ms, the causal kernel since removed; 1,024 x 6,404 ranged cross: 0.18 vs
0.31 ms; benchmarks/RESULTS.md), so the CUDA back-end uses it too, except for cross prefills
of few queries over many vision tokens (``triton_prefill.ranged_cross_attention`` with key
splits fills the GPU there). Prefill runs eagerly, never captured: looping over host lengths
is fine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def varlen_causal_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention within each packed sequence (prompts start at position 0). Rows after
    the last sequence (a padded step's) are left unwritten."""
    out = torch.empty_like(query)
    start = 0
    for n in seq_lens:
        end = start + n
        out[start:end] = _sdpa(query[start:end], key[start:end], value[start:end], scale, True)
        start = end
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
