"""Paged decode attention in Triton: split-K over a fixed number of KV segments, then a combine.

One query token per sequence reads its K/V through a page table (self-attention: the
sequence's pages and ``seq_lens``; cross-attention: the encoder pages and ``encoder_seq_lens``).

Why this shape (docs/architecture.md, "The CUDA-graph contract"):

* The launch depends only on static configuration and the batch size: the grid is
  ``(num_segments, num_kv_heads, batch)`` for the segment kernel and ``(batch, num_heads)`` for
  the combine, so one captured graph serves every mix of lengths. Each segment computes its own
  share of its sequence on the device (``_segment_chunk``), so a batch of one with a long KV
  still spreads over ``num_segments * num_kv_heads`` programs and fills the GPU.
* A sequence's result depends only on its own length, its K/V and the static configuration:
  not on batch-mates, the page-table width or any host maximum. The combine reduces the
  segments of one (sequence, head) in one fixed order. Same inputs, same bits.
* One program handles all query heads of one KV head (GQA), so K/V are read once. The group is
  padded to 16 rows for ``tl.dot``; the extra rows are zeros and never stored, except that
  with ``kv_ids`` they carry the next rows of one row chunk (a prompt's tokens run as decode
  rows over the same pages): a 50-token chunk over a 4-tile image then reads the image's
  cross K/V 13 times instead of 50 (11B, 4 query heads a KV head).
* Nothing past a sequence's length is read: neither the page table nor the cache rows (the
  null page and the tails of last pages may hold garbage, NaN included). A zero-length KV has
  no active segment and yields exact zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.attention.kv_cache_dtype import is_fp8

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Static tuning of the decode kernels (sweep these on the target GPU).

    ``num_segments`` is the fixed split count per (sequence, KV head); ``min_chunk`` the
    smallest share of a segment (a multiple of ``block_n``), so short sequences use fewer
    segments and write fewer partial results.
    """

    num_segments: int = 64
    block_n: int = 64
    min_chunk: int = 128
    num_warps: int = 4
    num_stages: int = 2
    combine_segments: int = 32
    combine_num_warps: int = 1
    combine_num_stages: int = 2
    # Rows of one row chunk served by one program (a power of two); 0: ``rows_per_program``.
    rows: int = 0

    def __post_init__(self) -> None:
        if self.rows < 0 or self.rows & (self.rows - 1):
            raise ValueError(f"rows must be 0 or a power of two, got {self.rows}")
        for name, low in (("num_segments", 1), ("block_n", 16), ("combine_segments", 1)):
            value = getattr(self, name)
            if value < low or value & (value - 1):
                at_least = f" >= {low}" if low > 1 else ""
                raise ValueError(f"{name} must be a power of two{at_least}, got {value}")
        if self.min_chunk < self.block_n or self.min_chunk % self.block_n:
            raise ValueError(
                f"min_chunk ({self.min_chunk}) must be a positive multiple of "
                f"block_n ({self.block_n})"
            )


DEFAULT_DECODE_CONFIG = DecodeConfig()
# fp32 caches (tests, CPU parity): IEEE products need twice the warps to stay out of spills.
FP32_DECODE_CONFIG = DecodeConfig(num_warps=8)


def default_decode_config(dtype: torch.dtype) -> DecodeConfig:
    """The split and launch used when none is given (a function of the cache dtype only)."""
    return FP32_DECODE_CONFIG if dtype == torch.float32 else DEFAULT_DECODE_CONFIG


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs need IEEE products (the default would round them to tf32 on the GPU)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _segment_chunk(
    length, NUM_SEGMENTS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr
):
    """Tokens per segment for a KV of ``length``: a function of the length alone."""
    per = tl.cdiv(length, NUM_SEGMENTS)
    per = tl.cdiv(per, BLOCK_N) * BLOCK_N
    return tl.maximum(per, MIN_CHUNK)


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax (log2 domain).

    s: [M, N] fp32 scores already scaled by ``scale * log2(e)``, -inf where masked;
    v: [N, D]; m_i, l_i: [M] running max and sum; acc: [M, D] fp32 unnormalised output.
    A row whose scores are all -inf so far keeps m = -inf, l = 0, acc = 0 (never NaN).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Subtract 0 instead of -inf for rows with nothing visible yet: exp2(-inf) = 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_segment_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    kv_ids_ptr,
    ws_ptr,
    scale_log2,
    batch,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_kt,
    stride_vp,
    stride_vh,
    stride_vt,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WS_ROW: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Grid (NUM_SEGMENTS, num_kv_heads, batch): one segment of one (sequence, KV head).

    Writes the segment's unnormalised output and its (max, sum) for every query head of the
    group into the workspace row ``[b, head, seg]``; inactive segments write nothing.

    With ``ROWS > 1`` (``kv_ids`` given), the program of row ``b = k * ROWS`` also serves the
    rows after it, up to ``b + ROWS - 1``, that have its id and split (the tokens of one row
    chunk: the same pages, lengths a few tokens apart): their query heads fill the tile rows
    that GQA leaves empty, and the K/V tiles are read once for all of them. Those rows'
    own programs return at once. A served row's result is the one its own program would
    give: the tile rows are independent, and the tiles past its length add exact zeros.
    """
    seg = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    length = tl.load(seq_lens_ptr + b)
    chunk = _segment_chunk(length, NUM_SEGMENTS, BLOCK_N, MIN_CHUNK)
    offs_g = tl.arange(0, BLOCK_G)
    row_of = offs_g // GROUP  # tile row -> which of the program's rows
    heads = kvh * GROUP + offs_g % GROUP
    if ROWS > 1:
        lead = b - b % ROWS
        my_id = tl.load(kv_ids_ptr + b)
        lead_chunk = _segment_chunk(tl.load(seq_lens_ptr + lead), NUM_SEGMENTS, BLOCK_N, MIN_CHUNK)
        served = (lead != b) & (tl.load(kv_ids_ptr + lead) == my_id) & (lead_chunk == chunk)
        rows = b + row_of
        # A row that no leader serves handles itself alone.
        in_tile = tl.where(lead == b, (row_of < ROWS) & (rows < batch), row_of == 0)
        ids = tl.load(kv_ids_ptr + rows, mask=in_tile, other=-1)
        lens = tl.load(seq_lens_ptr + rows, mask=in_tile, other=0)
        mine = in_tile & (ids == my_id)
        mine = mine & (_segment_chunk(lens, NUM_SEGMENTS, BLOCK_N, MIN_CHUNK) == chunk)
    else:
        served = False
        rows = b + row_of * 0
        lens = tl.full([BLOCK_G], 0, dtype=tl.int32) + length
        mine = row_of == 0
    start = seg * chunk
    ends = tl.minimum(start + chunk, lens)
    active = mine & (start < lens)
    end = tl.max(tl.where(active, ends, start), 0)
    end = tl.where(served, start, end)  # a served row's leader writes its segments
    if end > start:
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + rows.to(tl.int64)[:, None] * stride_qb + heads[:, None] * stride_qh
            + offs_d[None, :],
            mask=active[:, None] & d_mask[None, :],
            other=0.0,
        )
        # Products in the cache dtype, except that an FP8 cache is widened to the query's.
        if not KV_FP8:
            q = q.to(k_cache_ptr.dtype.element_ty)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        table = block_tables_ptr + b.to(tl.int64) * stride_bt
        k_base = k_cache_ptr + kvh * stride_kh
        v_base = v_cache_ptr + kvh * stride_vh
        for n0 in range(start, end, BLOCK_N):
            tok = n0 + offs_n
            valid = tok < end
            # Only pages below the length are looked up: the table may be wider than needed
            # and its tail (or the null page) is never touched.
            page = tl.load(table + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            slot_in_page = tok % PAGE_SIZE
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(
                k_base + (page * stride_kp + slot_in_page * stride_kt)[:, None] + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if KV_FP8:
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            s = tl.where(tok[None, :] < ends[:, None], s, float("-inf"))
            v = tl.load(
                v_base + (page * stride_vp + slot_in_page * stride_vt)[:, None] + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if KV_FP8:
                v = v.to(q.dtype)
            m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION)
        ws_rows = ((rows.to(tl.int64) * NUM_HEADS + heads) * NUM_SEGMENTS + seg) * WS_ROW
        tl.store(
            ws_ptr + ws_rows[:, None] + offs_d[None, :], acc,
            mask=active[:, None] & d_mask[None, :],
        )
        tl.store(ws_ptr + ws_rows + HEAD_DIM, m_i, mask=active)
        tl.store(ws_ptr + ws_rows + HEAD_DIM + 1, l_i, mask=active)


@triton.jit
def _decode_combine_kernel(
    ws_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WS_ROW: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
):
    """Grid (batch, num_heads): merges the active segments of one (sequence, head).

    The number of active segments is recomputed from the length, so segments that wrote
    nothing are never read. The segments are taken ``BLOCK_S`` at a time, in index order: a
    block is reduced at once and folded into a running maximum, so a short KV costs one
    small step and a long one a few. The order depends on the length alone.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(seq_lens_ptr + b)
    chunk = _segment_chunk(length, NUM_SEGMENTS, BLOCK_N, MIN_CHUNK)
    num_active = tl.cdiv(length, chunk)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    first = (b.to(tl.int64) * NUM_HEADS + h) * (NUM_SEGMENTS * WS_ROW)
    # 0-d running state (reductions of constant vectors give the loop a fixed scalar type).
    m_run = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0)
    l_run = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    num = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_active, BLOCK_S):
        s_mask = s0 + offs_s < num_active
        rows = first + (s0 + offs_s) * WS_ROW
        m = tl.load(ws_ptr + rows + HEAD_DIM, mask=s_mask, other=float("-inf"))
        seg_l = tl.load(ws_ptr + rows + HEAD_DIM + 1, mask=s_mask, other=0.0)
        acc = tl.load(
            ws_ptr + rows[:, None] + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        # The block holds at least one active segment, whose maximum is finite.
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.exp2(m_run - m_new)  # 0 on the first block (m_run = -inf)
        w = tl.where(s_mask, tl.exp2(m - m_new), 0.0)
        l_run = l_run * alpha + tl.sum(w * seg_l, 0)
        num = num * alpha + tl.sum(acc * w[:, None], 0)
        m_run = m_new
    # A zero-length KV has l_run 0: exact zeros, never 0/0.
    out = tl.where(l_run > 0.0, num / tl.where(l_run > 0.0, l_run, 1.0), 0.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def workspace_row(head_dim: int) -> int:
    """fp32 words per (sequence, head, segment): the output, then max and sum, 16-byte rows."""
    return (head_dim + 2 + 3) // 4 * 4


def alloc_decode_workspace(
    batch: int,
    num_heads: int,
    head_dim: int,
    device: torch.device,
    config: DecodeConfig = DEFAULT_DECODE_CONFIG,
) -> torch.Tensor:
    """[batch, num_heads, num_segments, workspace_row] fp32; its shape never depends on lengths."""
    return torch.empty(
        batch,
        num_heads,
        config.num_segments,
        workspace_row(head_dim),
        dtype=torch.float32,
        device=device,
    )


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_pages, num_kv_heads, page_size, head_dim], any strides
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32; W >= pages needed by the longest sequence
    seq_lens: torch.Tensor,  # [B] int32; 0 gives a zero output
    scale: float,
    *,
    # [B] int32: rows with equal ids read the same pages (one sequence's row chunk), so one
    # program may serve several of them (``DecodeConfig.rows``); None: every row its own.
    kv_ids: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim], written entirely
    workspace: torch.Tensor | None = None,  # from alloc_decode_workspace
    config: DecodeConfig | None = None,  # None: default_decode_config(compute dtype)
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V (fp32 accumulate).

    The products run in the cache dtype, or in the query's for an FP8 cache (its rows are
    widened after the load: the ``kv_cache_dtype`` semantics).

    Free of host synchronisation and of launch parameters that depend on lengths: safe to
    capture in a CUDA graph.
    """
    b, num_heads, head_dim = query.shape
    _, num_kv_heads, page_size, cache_dim = key_cache.shape
    assert cache_dim == head_dim and value_cache.shape == key_cache.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    kv_fp8 = is_fp8(key_cache.dtype)
    compute = query.dtype if kv_fp8 else key_cache.dtype
    config = config or default_decode_config(compute)
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert block_tables.stride(-1) == 1 and seq_lens.is_contiguous()
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    assert out.shape == query.shape and out.stride(-1) == 1
    if b == 0:
        return out
    if workspace is None:
        workspace = alloc_decode_workspace(b, num_heads, head_dim, query.device, config)
    assert workspace.is_contiguous() and workspace.dtype == torch.float32
    assert workspace.shape == (b, num_heads, config.num_segments, workspace_row(head_dim))
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = 1 if kv_ids is None else rows_per_program(group, config)
    if kv_ids is not None:
        assert kv_ids.dtype == torch.int32 and kv_ids.shape == (b,) and kv_ids.is_contiguous()
    block_g = max(16, triton.next_power_of_2(group * rows))
    _decode_segment_kernel[(config.num_segments, num_kv_heads, b)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        seq_lens if kv_ids is None else kv_ids,  # not read with one row a program
        workspace,
        scale * LOG2E,
        b,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        ROWS=rows,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        WS_ROW=workspace_row(head_dim),
        BLOCK_G=block_g,
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        NUM_SEGMENTS=config.num_segments,
        MIN_CHUNK=config.min_chunk,
        DOT_PRECISION=dot_precision(compute),
        KV_FP8=kv_fp8,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _decode_combine_kernel[(b, num_heads)](
        workspace,
        seq_lens,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        WS_ROW=workspace_row(head_dim),
        BLOCK_S=min(config.combine_segments, config.num_segments),
        BLOCK_D=block_d,
        BLOCK_N=config.block_n,
        NUM_SEGMENTS=config.num_segments,
        MIN_CHUNK=config.min_chunk,
        num_warps=config.combine_num_warps,
        num_stages=config.combine_num_stages,
    )
    return out


def rows_per_program(group: int, config: DecodeConfig = DEFAULT_DECODE_CONFIG) -> int:
    """Rows of one row chunk that one program serves: ``config.rows``, or (0) as many as
    fill the 16-row tile GQA pads its group to (4 at 4 query heads a KV head, 2 at 8)."""
    if config.rows:
        return config.rows
    return max(1, 16 // triton.next_power_of_2(group))


def active_segments(length: int, config: DecodeConfig = DEFAULT_DECODE_CONFIG) -> int:
    """Host mirror of the device split (for tests and the benchmark's accounting)."""
    per = math.ceil(length / config.num_segments)
    per = max(math.ceil(per / config.block_n) * config.block_n, config.min_chunk)
    return math.ceil(length / per)
