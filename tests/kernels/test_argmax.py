"""The Triton row argmax against torch.argmax: exact indices, ties, NaN, -inf, row tails.

Without a GPU it runs in Triton's interpreter on CPU tensors (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.triton_argmax import argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,block", [(1, 2048), (7, 2048), (4096, 2048), (4097, 2048),
                                     (3 * 4096 + 5, 2048), (3 * 4096 + 5, 1024),
                                     (20000, 512)])  # the last: 40 tiles, a wider merge
def test_argmax_matches_torch(n: int, block: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[1] = float("-inf")  # all -inf: index 0
    x[2] = 0.5  # all tied: the first
    if n > 3:
        x[3, n // 2] = float("nan")  # NaN beats everything ...
        x[3, n - 1] = float("nan")  # ... and the first NaN wins
        x[4, [1, n - 1]] = 1e30  # a tie of maxima in different lanes and tiles
        x[5, n - 1] = float("inf")
    x = x.to(DEVICE)
    assert torch.equal(argmax_rows(x, block=block), x.argmax(dim=-1))


def test_argmax_strided_rows_and_out() -> None:
    """A row-strided view (the decode graphs' shared logits buffer) into a given output."""
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(5, 3000, generator=g).to(DEVICE)
    view = buf[1:4, :2500]
    out = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(view, out=out) is out
    assert torch.equal(out, view.argmax(dim=-1))
    assert argmax_rows(buf[:0]).shape == (0,)
