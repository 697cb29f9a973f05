"""Row-wise argmax in Triton, with ``torch.argmax``'s exact answer.

A greedy decode step reduces ``[batch, vocab]`` float32 logits to token ids. ``torch.argmax``
gives a row to one thread block: for the 128,256-entry vocabulary on an H200 about 27 us per
call inside a CUDA graph (40 us launched alone), longer than a decode layer. Here each row is
split over ``cdiv(vocab, BLOCK)`` programs that each reduce one tile to (best value, first
index), and a second small kernel reduces those partials per row; both run inside the decode
graph.

Same result as ``torch.argmax(dim=-1)``: the first index of the maximum; NaN counts as larger
than everything (the first NaN wins); a row of -inf gives 0. Only comparisons, no arithmetic,
so the answer is exact whatever the split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # H200, in a graph: 3.0 / 4.0 / 9.8 us at batch 1 / 8 / 64 (torch.argmax ~27 us)


@triton.jit
def _first_max(v, idx, valid, big):
    """(value, first index) of the largest entry of a tile; NaN ranks above everything and
    the result value is then NaN. ``valid`` marks the real entries; ``big`` exceeds any
    index."""
    is_nan = v != v
    first_nan = tl.min(tl.where(is_nan, idx, big), 0)
    finite = tl.where(is_nan, float("-inf"), v)
    m = tl.max(finite, 0)
    first = tl.min(tl.where(valid & (finite == m), idx, big), 0)
    has_nan = first_nan < big
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, first)


@triton.jit
def _argmax_tiles_kernel(x_ptr, val_ptr, idx_ptr, n, stride, num_tiles, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=valid, other=float("-inf"))
    m, i = _first_max(x.to(tl.float32), offs, valid, n + BLOCK)
    tl.store(val_ptr + row * num_tiles + tile, m)
    tl.store(idx_ptr + row * num_tiles + tile, i)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, n, num_tiles, TILES_PAD: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.arange(0, TILES_PAD)
    valid = t < num_tiles
    v = tl.load(val_ptr + row * num_tiles + t, mask=valid, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_tiles + t, mask=valid, other=0)
    # Tiles are in index order, so the first index among the best tiles is the answer.
    _, best = _first_max(v, i, valid, n + BLOCK)
    tl.store(out_ptr + row, best.to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None,
                block: int = BLOCK) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for a 2-D float tensor with unit stride along the row
    (CUDA, or Triton's interpreter on CPU); ``out``: int64 [rows] to write into; ``block``:
    entries per tile program (a power of two)."""
    rows, n = logits.shape
    assert logits.stride(1) == 1 and n > 0
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64
    if rows == 0:
        return out
    tiles = triton.cdiv(n, block)
    vals = torch.empty(rows, tiles, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows, tiles, dtype=torch.int32, device=logits.device)
    _argmax_tiles_kernel[(rows, tiles)](logits, vals, idxs, n, logits.stride(0), tiles,
                                        BLOCK=block, num_warps=4)
    _argmax_merge_kernel[(rows,)](vals, idxs, out, n, tiles,
                                  TILES_PAD=max(16, triton.next_power_of_2(tiles)), BLOCK=block,
                                  num_warps=1)
    return out
