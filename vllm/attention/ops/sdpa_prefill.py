"""Prefill attention through torch SDPA on a bounded set of shapes.

On CUDA, SDPA's cuDNN back-end (the fastest prefill attention on Hopper here) builds an
execution plan for every new combination of shapes and strides: 37-55 ms of host time per new
prompt length on the H200, measured in isolation (benchmarks/RESULTS.md); in a server that
would stall every running stream once per new length. These functions pad each sequence's
query (and, for causal attention, key/value) length up to a bucket, so a served workload meets
at most ``len(buckets)`` plans per head shape, which the start-up warm-up builds ahead
(``warm_up_plans``).

Padding is exact for the real rows:
* causal: real query ``i`` attends keys ``0..i``, all real; the padding keys sit after every
  real row and are masked for it. The padding rows are zeros (finite, so a masked weight of 0
  times a padding value is 0) and their own outputs are dropped.
* cross: query rows are independent; padding query rows are computed and dropped. Key/value
  lengths are whole images (``tokens_per_image`` each), already a bounded set.
Inputs are copied into buffers of one fixed layout per bucket (contiguous ``[L, H, D]``,
query/key/value side by side per row for causal), so plans do not depend on the caller's
strides either. (The step's own next rows are not used as padding: a non-finite value in
another request's K/V would reach this one's rows through a zero weight.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MIN_BUCKET = 16
_STEPS_PER_OCTAVE = 4  # bucket spacing: under 25% padding above 64 tokens


def bucket_len(n: int) -> int:
    """The padded length for ``n`` >= 1 tokens: multiples of 16 up to 64, then four per
    octave (80, 96, 112, 128, 160, ...)."""
    if n < 1:
        raise ValueError(f"bucket_len needs n >= 1, got {n}")
    octave = (n - 1).bit_length() - 1  # n in (2**octave, 2**(octave + 1)]
    step = max(_MIN_BUCKET, (1 << max(0, octave)) // _STEPS_PER_OCTAVE)
    return -(-n // step) * step


def buckets_up_to(max_len: int) -> list[int]:
    """Every bucket a length in ``1..max_len`` can map to, ascending."""
    out: list[int] = []
    n = 1
    while n <= max_len:
        b = bucket_len(n)
        out.append(b)
        n = b + 1
    return out


def causal_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention within each packed sequence (prompts start at position 0), each
    sequence padded to ``bucket_len``. Same result as ``reference.varlen_causal_attention``
    up to the kernel's rounding. -> [T, Hq, D]"""
    hq, hkv = query.shape[1], key.shape[1]
    fused = _fused_rows(query, key, value)
    out = torch.empty_like(query)
    start = 0
    for n in seq_lens:
        if n == 0:
            continue
        length = bucket_len(n)
        # [L, Hq + 2 Hkv, D]: one zeroing launch for the padding rows of all three.
        buf = query.new_empty(length, hq + 2 * hkv, query.shape[2])
        buf[n:].zero_()
        q, k, v = buf[:, :hq], buf[:, hq:hq + hkv], buf[:, hq + hkv:]
        if fused is not None:
            buf[:n] = fused[start:start + n]
        else:
            q[:n] = query[start:start + n]
            k[:n] = key[start:start + n]
            v[:n] = value[start:start + n]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)
        out[start:start + n] = o[0, :, :n].transpose(0, 1)
        start += n
    return out


def _fused_rows(query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor | None:
    """[T, Hq + 2 Hkv, D] over the same memory when q, k and v are adjacent head ranges of
    one fused projection row (as the model's QKV split hands them over), else None; one
    copy launch then moves all three."""
    d, es = query.shape[2], query.element_size()
    hq, hkv = query.shape[1], key.shape[1]
    same = (query.stride(0) == key.stride(0) == value.stride(0)
            and all(t.stride(1) == d and t.stride(2) == 1 for t in (query, key, value))
            and key.dtype == value.dtype == query.dtype)
    if not (same and key.data_ptr() == query.data_ptr() + hq * d * es
            and value.data_ptr() == key.data_ptr() + hkv * d * es):
        return None
    return query.as_strided((query.shape[0], hq + 2 * hkv, d), (query.stride(0), d, 1))


def ranged_cross_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [S, Hkv, D] packed vision tokens of the step
    value: torch.Tensor,
    runs: list[tuple[int, int, int, int]],  # (q0, q1, kv0, kv1)
    scale: float,
) -> torch.Tensor:
    """``reference.ranged_cross_attention`` with each run's query count padded to
    ``bucket_len`` (queries outside every run, or with an empty range, get zeros)."""
    out = torch.zeros_like(query)
    for q0, q1, kv0, kv1 in runs:
        if kv1 <= kv0 or q1 <= q0:
            continue
        n = q1 - q0
        q = query.new_empty(bucket_len(n), *query.shape[1:])
        q[:n] = query[q0:q1]  # padding rows: whatever the buffer held; their outputs drop
        k = key[kv0:kv1].contiguous()
        v = value[kv0:kv1].contiguous()
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), scale=scale, enable_gqa=True)
        out[q0:q1] = o[0, :, :n].transpose(0, 1)
    return out


def warm_up_plans(
    max_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    cross_kv_lens: list[int],
) -> int:
    """Runs every bucket up to ``max_len`` once: causal, and cross over each vision length
    in ``cross_kv_lens``, so the library builds its plans now, not while serving. Returns
    the number of calls."""
    calls = 0
    for length in buckets_up_to(max_len):
        q = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(length, num_kv_heads, head_dim, dtype=dtype, device=device)
        causal_attention(q, kv, kv, [length], 1.0)
        calls += 1
        for s in cross_kv_lens:
            vis = torch.zeros(s, num_kv_heads, head_dim, dtype=dtype, device=device)
            ranged_cross_attention(q, vis, vis, [(0, length, 0, s)], 1.0)
            calls += 1
    return calls
