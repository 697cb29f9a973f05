"""The decode graphs' first and last kernels: the rows' inputs gathered in one launch; each
real row takes its greedy token and moves on.

Separate from ``decode_state`` so that CPU installs (no Triton) never import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_rows_kernel(rows_ptr, ids_ptr, tokens_ptr, positions_ptr, n, null_row,
                         BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    live = i < n
    row = tl.load(rows_ptr + i, mask=live, other=0)
    live = live & (row != null_row)
    tl.store(tokens_ptr + row, tl.load(ids_ptr + i, mask=live), mask=live)
    tl.store(positions_ptr + row, tl.load(positions_ptr + row, mask=live) + 1, mask=live)


def advance_rows(rows: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor,
                 positions: torch.Tensor, null_row: int) -> None:
    """``tokens[r] = ids[i]; positions[r] += 1`` for each ``r = rows[i]`` but the null row,
    in one kernel (CUDA, or Triton's interpreter on CPU); real rows are distinct."""
    n = rows.shape[0]
    if n:
        _advance_rows_kernel[(1,)](rows, ids, tokens, positions, n, null_row,
                                   BLOCK=max(16, triton.next_power_of_2(n)), num_warps=1)


@triton.jit
def _gather_rows_kernel(rows_ptr, tokens_ptr, positions_ptr, tables_ptr, enc_lens_ptr,
                        cross_ptr, kv_ids_ptr, ids_out, pos_out, lens_out, slots_out, tables_out,
                        enc_out, cross_out, kv_ids_out, table_stride, cross_stride, width,
                        cross_width, PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr):
    """Grid (batch,): one row's token, position, length, slot, page tables, vision length and
    page-sharing id."""
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    tl.store(kv_ids_out + b, tl.load(kv_ids_ptr + row))
    pos = tl.load(positions_ptr + row)
    tl.store(ids_out + b, tl.load(tokens_ptr + row))
    tl.store(pos_out + b, pos)
    tl.store(lens_out + b, (pos + 1).to(tl.int32))
    tl.store(enc_out + b, tl.load(enc_lens_ptr + row))
    # Padding rows (position -1) look up page 0 of their own table and write slot -1.
    p0 = tl.maximum(pos, 0)
    page = tl.load(tables_ptr + row * table_stride + p0 // PAGE_SIZE).to(tl.int64)
    tl.store(slots_out + b, tl.where(pos >= 0, page * PAGE_SIZE + p0 % PAGE_SIZE, -1))
    offs = tl.arange(0, BLOCK_W)
    for w0 in range(0, width, BLOCK_W):
        m = w0 + offs < width
        t = tl.load(tables_ptr + row * table_stride + w0 + offs, mask=m)
        tl.store(tables_out + b.to(tl.int64) * width + w0 + offs, t, mask=m)
    for w0 in range(0, cross_width, BLOCK_W):
        m = w0 + offs < cross_width
        t = tl.load(cross_ptr + row * cross_stride + w0 + offs, mask=m)
        tl.store(cross_out + b.to(tl.int64) * cross_width + w0 + offs, t, mask=m)


def gather_rows(rows: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                tables: torch.Tensor, encoder_lens: torch.Tensor, cross_tables: torch.Tensor,
                kv_ids: torch.Tensor, page_size: int, width: int,
                cross_width: int) -> tuple[torch.Tensor, ...]:
    """``DecodeRows.gather`` in one kernel: (input_ids, positions, seq_lens, slot_mapping,
    block_tables [B, width], encoder_seq_lens, cross_block_tables [B, cross_width], kv_ids)."""
    n, dev = rows.shape[0], rows.device
    assert tables.stride(1) == 1 and cross_tables.stride(1) == 1
    assert width <= tables.shape[1] and cross_width <= cross_tables.shape[1]
    out = (torch.empty(n, dtype=torch.int64, device=dev),
           torch.empty(n, dtype=torch.int64, device=dev),
           torch.empty(n, dtype=torch.int32, device=dev),
           torch.empty(n, dtype=torch.int64, device=dev),
           torch.empty(n, width, dtype=torch.int32, device=dev),
           torch.empty(n, dtype=torch.int32, device=dev),
           torch.empty(n, cross_width, dtype=torch.int32, device=dev),
           torch.empty(n, dtype=torch.int32, device=dev))
    if n:
        _gather_rows_kernel[(n,)](rows, tokens, positions, tables, encoder_lens, cross_tables,
                                  kv_ids, *out, tables.stride(0), cross_tables.stride(0), width,
                                  cross_width, PAGE_SIZE=page_size, BLOCK_W=256, num_warps=2)
    return out
