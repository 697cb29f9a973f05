"""The interpreter's bounds checks (CPU): they catch a load and a store past a tensor, and let
masked-off lanes and views of a larger tensor through."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from helpers.triton_bounds import OutOfBoundsAccess, check_addresses  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _copy(src, dst, n, extra, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(src + i + extra, mask=i < n)
    tl.store(dst + i, x, mask=i < n)


def test_check_addresses() -> None:
    import numpy as np

    ranges = [(1000, 1016), (2000, 2008)]
    check_addresses(np.array([1000, 1012, 2004]), 4, ranges, "load", "k")
    with pytest.raises(OutOfBoundsAccess, match="k: store of 1 element"):
        check_addresses(np.array([1000, 1013]), 4, ranges, "store", "k")
    check_addresses(np.array([], dtype=np.uint64), 4, [], "load", "k")


@pytest.mark.skipif(not INTERPRETED, reason="checks Triton's interpreter")
def test_interpreted_kernels_are_checked() -> None:
    src, dst = torch.arange(8.0), torch.zeros(8)
    _copy[(1,)](src, dst, 8, 0, BLOCK=16)  # lanes 8..15 masked off
    assert torch.equal(dst, src)
    big = torch.arange(16.0)
    _copy[(1,)](big[4:], dst, 8, 4, BLOCK=8)  # past the view, inside its storage: allowed
    assert torch.equal(dst, big[8:])
    with pytest.raises(Exception, match="_copy: load of 1 element"):
        _copy[(1,)](src, dst, 8, 1, BLOCK=8)  # reads src[8]
    with pytest.raises(Exception, match="_copy: store of 2 element"):
        _copy[(1,)](src, dst[:6].clone(), 8, 0, BLOCK=8)  # writes 2 past a 6-element tensor
