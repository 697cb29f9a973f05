"""Ranged cross-attention in Triton, with key splits: few queries over many vision tokens.

Every query ``t`` sees vision tokens ``[ranges[t, 0], ranges[t, 1])`` of the step's packed
K/V. The kernel is flash-attention style: a program owns a tile of ``BLOCK_M`` queries of one
head, streams ``BLOCK_N`` keys at a time through an online softmax in fp32, and visits the
union of its queries' non-empty ranges with a per-query mask (an empty range gives zeros).
With key splits the tile's keys are shared out over several programs and merged after, which
fills the GPU for the text of one image prompt (128 queries over 6,404 vision tokens) and for
the vision tower's padding rows (``vision_attention.py``); SDPA is used elsewhere
(``sdpa.py``). Prefill steps run eagerly (never captured), so the grids may use host lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.attention.ops.triton_decode import LOG2E, dot_precision, online_softmax_update


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and launch of the ranged kernel (sweep on the target GPU)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


# For head_dim <= 128. Half precision: wgmma tiles, three cp.async stages (sm_90, no spills).
# fp32 (tests, CPU parity) takes IEEE products on the FMA units, whose operands need many
# more registers: a small tile is the largest found to compile for sm_90 without spilling.
HALF_PREFILL_CONFIG = PrefillConfig()
FP32_PREFILL_CONFIG = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def default_prefill_config(dtype: torch.dtype) -> PrefillConfig:
    """The tile shape used when none is given (a function of the input dtype only)."""
    return FP32_PREFILL_CONFIG if dtype == torch.float32 else HALF_PREFILL_CONFIG


@triton.jit
def _load_rows(base_ptr, rows, stride_row, offs_d, mask):
    """[len(rows), BLOCK_D] tile of a [tokens, heads, head_dim] tensor (head already applied)."""
    return tl.load(
        base_ptr + rows.to(tl.int64)[:, None] * stride_row + offs_d[None, :], mask=mask, other=0.0
    )


# The token count varies with every prompt: one compiled variant for all of them.
@triton.jit(do_not_specialize=["num_tokens"])
def _ranged_cross_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    ranges_ptr,
    num_tokens,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_rt,
    part_ptr,
    stats_ptr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Grid (query tiles, query heads, key splits) over all packed text tokens of the step.

    With one split the program writes its normalised tile. With more, split ``j`` takes the
    ``j``-th of NUM_SPLITS equal BLOCK_N-aligned parts of the tile's key union and writes its
    unnormalised fp32 accumulator and (max, sum) to the workspace for ``_split_combine_kernel``.
    """
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < num_tokens
    r_rows = ranges_ptr + offs_m.to(tl.int64) * stride_rt
    lo_q = tl.load(r_rows, mask=m_mask, other=0)
    hi_q = tl.load(r_rows + 1, mask=m_mask, other=0)
    nonempty = hi_q > lo_q
    # The union of the tile's non-empty ranges; empty ones must not widen it. A tile with
    # none gets lo = hi = 0: the int32 sentinel must not reach the key arithmetic below, where
    # lo + offsets wraps negative and passes the `keys < hi` mask. (The H200 faulted in this
    # kernel on such a tile, likely through the pipelined loop's first loads.)
    lo = tl.min(tl.where(nonempty, lo_q, 2147483647), 0)
    hi = tl.max(tl.where(nonempty, hi_q, 0), 0)
    lo = tl.minimum(lo, hi)
    q = _load_rows(
        q_ptr + h * stride_qh, offs_m, stride_qt, offs_d, m_mask[:, None] & d_mask[None, :]
    )
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        part = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * part
        hi = tl.minimum(hi, lo + part)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + offs_n
        n_mask = keys < hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = _load_rows(k_base, keys, stride_kt, offs_d, kv_mask)
        v = _load_rows(v_base, keys, stride_vt, offs_d, kv_mask)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (keys[None, :] >= lo_q[:, None]) & (keys[None, :] < hi_q[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)
    out_mask = m_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS > 1:
        # Workspace [splits, tokens, heads, D] fp32 and [splits, tokens, heads, 2] (max, sum).
        heads = tl.num_programs(1)
        row = (tl.program_id(2) * num_tokens + offs_m.to(tl.int64)) * heads + h
        tl.store(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(stats_ptr + row * 2, m_i, mask=m_mask)
        tl.store(stats_ptr + row * 2 + 1, l_i, mask=m_mask)
    else:
        # Queries that saw nothing have l = 0 and acc = 0: exact zeros.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_ot + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=out_mask,
        )


# The token count varies with every prompt: one compiled variant for all of them.
@triton.jit(do_not_specialize=["num_tokens"])
def _split_combine_kernel(
    part_ptr,
    stats_ptr,
    o_ptr,
    num_tokens,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Grid (query tiles, query heads): merges the splits' partial softmax states in a fixed
    order (split 0 first). Queries no split saw (l = 0 everywhere) get exact zeros."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < num_tokens
    mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(NUM_SPLITS):
        row = (j * num_tokens + offs_m.to(tl.int64)) * heads + h
        m_max = tl.maximum(m_max, tl.load(stats_ptr + row * 2, mask=m_mask,
                                          other=float("-inf")))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(NUM_SPLITS):
        row = (j * num_tokens + offs_m.to(tl.int64)) * heads + h
        w = tl.exp2(tl.load(stats_ptr + row * 2, mask=m_mask, other=float("-inf")) - m_use)
        l_sum += w * tl.load(stats_ptr + row * 2 + 1, mask=m_mask, other=0.0)
        part = tl.load(part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask,
                       other=0.0)
        acc += w[:, None] * part
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    tl.store(o_ptr + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_ot
             + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)


def _check_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Unit last-dim strides (other strides are passed through) and the GQA group size."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    assert key.shape == value.shape and key.shape[-1] == query.shape[-1]
    assert query.shape[1] % key.shape[1] == 0, "query heads must be a multiple of KV heads"
    return query, key, value, query.shape[1] // key.shape[1]


def ranged_cross_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [S, num_kv_heads, head_dim] packed vision tokens of the step
    value: torch.Tensor,
    kv_ranges: torch.Tensor,  # [T, 2] int32: [start, end) per query; empty -> zeros
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
    config: PrefillConfig | None = None,  # None: default_prefill_config(query.dtype)
    num_splits: int = 1,
) -> torch.Tensor:
    """Cross-attention where each query sees one contiguous range of vision tokens.

    ``num_splits`` > 1 splits every query tile's keys into that many parts run by separate
    programs, then merges them (flash-decoding style): for few queries over many vision
    tokens, where one program per (tile, head) leaves most of the GPU idle
    (``split_count`` picks it from the grid and the GPU's size)."""
    query, key, value, group = _check_qkv(query, key, value)
    assert kv_ranges.dtype == torch.int32 and kv_ranges.shape == (query.shape[0], 2)
    assert kv_ranges.stride(-1) == 1 and num_splits >= 1
    cfg = config or default_prefill_config(query.dtype)
    num_tokens, num_heads, head_dim = query.shape
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    assert out.shape == query.shape and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    grid = (triton.cdiv(num_tokens, cfg.block_m), num_heads, num_splits)
    if num_splits > 1:
        part = torch.empty(num_splits, num_tokens, num_heads, head_dim,
                           dtype=torch.float32, device=query.device)
        stats = torch.empty(num_splits, num_tokens, num_heads, 2,
                            dtype=torch.float32, device=query.device)
    else:
        part = stats = out  # unused
    _ranged_cross_kernel[grid](
        query,
        key,
        value,
        out,
        kv_ranges,
        num_tokens,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        kv_ranges.stride(0),
        part,
        stats,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION=dot_precision(query.dtype),
        NUM_SPLITS=num_splits,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        block_m = 16
        _split_combine_kernel[(triton.cdiv(num_tokens, block_m), num_heads)](
            part, stats, out, num_tokens, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            NUM_SPLITS=num_splits, num_warps=4)
    return out


def split_count(num_tokens: int, num_heads: int, num_keys: int, num_sms: int,
                config: PrefillConfig) -> int:
    """Key splits for ``ranged_cross_attention`` so its grid about fills the GPU once: 1 when
    the (query tile, head) programs alone fill ``num_sms``; at most one split per 4 key
    tiles (fewer keys are not worth a workspace round trip)."""
    base = triton.cdiv(num_tokens, config.block_m) * num_heads
    return max(1, min(num_sms // base, num_keys // (4 * config.block_n)))


def split_counts(num_heads: int, num_sms: int) -> list[int]:
    """Every value ``split_count`` can return for ``num_heads`` query heads on ``num_sms``
    SMs, ascending: 1 up to the SMs over one query tile's programs (fewer tokens or keys only
    lower it)."""
    return list(range(1, max(1, num_sms // num_heads) + 1))
