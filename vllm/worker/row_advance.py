"""The decode graphs' last kernel: each real row takes its greedy token and moves on.

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
