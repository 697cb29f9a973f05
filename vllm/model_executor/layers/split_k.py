"""A K split summed in the launch that computes it, for the weight-only decode GEMMs.

The programs of one output tile each sum a range of K and store their float32 partial sums
([SPLIT_K, M, width]); each then counts itself in on the tile's counter (an int32 per tile,
zero between calls). The one that arrives last adds every partial in split order, its own read
back too, so the sum is the same whichever program arrives last (the fixed reduction order the
graph contract needs), resets the counter to zero for the next call, and writes the output.
This saves the second kernel (a graph node) that a separate reduction costs per linear. The
counters of a layer are its own: two GEMMs on different streams never share one.
"""

from __future__ import annotations

import triton
import triton.language as tl


# fmt: off
@triton.jit
def arrive_last(c_ptr, tile, SPLIT_K: tl.constexpr):
    # After this program's partials are stored: whether it is the tile's last to arrive. The
    # barrier orders every thread's stores before the release of the count.
    tl.debug_barrier()
    return tl.atomic_add(c_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1


@triton.jit
def sum_partials(p_ptr, rows, cols, mask, M, width,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    # The last program: the partials of columns ``cols`` ([BLOCK_N]) of ``rows`` in split
    # order (read from L2: other programs wrote them).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        q = p_ptr + (s * M + rows.to(tl.int64))[:, None] * width + cols[None, :]
        acc += tl.load(q, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def reset_counter(c_ptr, tile):
    # The last program, once it has read the partials: the tile's count back to zero.
    tl.atomic_xchg(c_ptr + tile, 0)
# fmt: on


def tile_count(n_out: int, max_rows: int, min_tile: int) -> int:
    """Counters needed for an ``n_out``-column output of up to ``max_rows`` rows in tiles of
    at least ``min_tile`` rows and columns."""
    return triton.cdiv(n_out, min_tile) * triton.cdiv(max(max_rows, 1), min_tile)
