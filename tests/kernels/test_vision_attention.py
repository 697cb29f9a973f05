"""The vision tower's attention paths against a dense-mask SDPA (the reference's rule: only
padding-to-padding pairs masked), and the padding rows' split kernel against SDPA over the
valid keys.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1) in fp32; the ``gpu``-marked tests add the 11B shape in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.attention.ops.vision_attention import (
    MAX_SPLIT_PADDING_ROWS,
    padding_rows_attention,
    padding_rows_ranges,
    sdpa,
    vision_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _projected(g: int, length: int, heads: int, head_dim: int, dtype: torch.dtype,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model has them: [G, H, L, D] views of one [G, L, 3 * H * D] output."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(g, length, 3 * heads * head_dim, generator=gen).to(DEVICE, dtype)
    return tuple(t.view(g, length, heads, head_dim).transpose(1, 2)
                 for t in qkv.split(heads * head_dim, dim=-1))


def _expected(q, k, v, num_valid: int) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q[:, :, num_valid:].float(), k[:, :, :num_valid].float(), v[:, :, :num_valid].float())


def _ranges(num_pad: int, num_valid: int) -> torch.Tensor:
    return torch.tensor([[0, num_valid]] * num_pad, dtype=torch.int32, device=DEVICE)


def _dense_mask_reference(q, k, v, num_valid: int) -> torch.Tensor:
    """fp32 SDPA with a dense additive mask on padding-query x padding-key pairs
    -> [G, L, H * D]."""
    g, _, length, _ = q.shape
    pad = torch.arange(length, device=q.device) >= num_valid
    mask = torch.zeros(length, length, device=q.device)
    mask.masked_fill_(pad[:, None] & pad[None, :], float("-inf"))
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    return out.transpose(1, 2).reshape(g, length, -1)


@pytest.mark.parametrize("num_valid", [40, 33, 9])
@pytest.mark.parametrize("split", [False, True])
def test_vision_attention_matches_dense_mask(num_valid: int, split: bool) -> None:
    """Both padding paths (two SDPA calls joined; maskless + split padding rows), no padding,
    and a padding tail longer than the valid part."""
    g, length, heads, head_dim = 2, 40, 3, 80
    q, k, v = _projected(g, length, heads, head_dim, torch.float32, seed=num_valid)
    ranges = _ranges(length - num_valid, num_valid) if split and num_valid < length else None
    got = vision_attention(q, k, v, num_valid, ranges)
    assert got.shape == (g, length, heads * head_dim) and got.is_contiguous()
    torch.testing.assert_close(got, _dense_mask_reference(q, k, v, num_valid),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows_match_sdpa_over_valid_keys(num_splits: int) -> None:
    """Two images, head_dim 80 (not a power of two), a padding tail shorter than a tile;
    the valid rows are left as the maskless call wrote them."""
    g, length, num_valid, heads, head_dim = 2, 40, 33, 3, 80
    q, k, v = _projected(g, length, heads, head_dim, torch.float32, seed=5)
    out = sdpa(q, k, v)
    valid_before = out[:, :, :num_valid].clone()
    padding_before = out[:, :, num_valid:].clone()
    padding_rows_attention(q, k, v, out, num_valid, _ranges(length - num_valid, num_valid),
                           num_splits=num_splits)
    torch.testing.assert_close(out[:, :, num_valid:], _expected(q, k, v, num_valid),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, :, :num_valid], valid_before)
    # The rows changed: the maskless values were not the answer (pad keys carry weight).
    assert (out[:, :, num_valid:] - padding_before).abs().max() > 1e-3


def test_padding_rows_ranges_choose_the_split_kernel_only_for_few_rows() -> None:
    assert padding_rows_ranges(6432, 6404, DEVICE, split=False) is None  # torch kernels
    ranges = padding_rows_ranges(6432, 6404, DEVICE, split=True)
    assert ranges is not None and ranges.shape == (28, 2)
    assert ranges.dtype == torch.int32 and ranges.device.type == DEVICE.type
    assert (ranges[:, 0] == 0).all() and (ranges[:, 1] == 6404).all()
    assert padding_rows_ranges(6432, 6432, DEVICE, split=True) is None  # no padding
    assert padding_rows_ranges(6432, 1601, DEVICE, split=True) is None  # 4,831 rows: SDPA
    assert padding_rows_ranges(100 + MAX_SPLIT_PADDING_ROWS, 100, DEVICE, split=True) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padding_rows_at_the_11b_shape() -> None:
    """One 4-tile image (6,432 tokens, 6,404 valid), 16 heads of 80, bf16, the default tile
    and split count, inside a CUDA graph as the vision graph runs it."""
    length, num_valid = 6432, 6404
    q, k, v = _projected(1, length, 16, 80, torch.bfloat16, seed=6)
    ranges = padding_rows_ranges(length, num_valid, DEVICE, split=True)
    out = sdpa(q, k, v)
    padding_rows_attention(q, k, v, out, num_valid, ranges)
    expected = _expected(q, k, v, num_valid)
    torch.testing.assert_close(out[:, :, num_valid:].float(), expected, atol=2e-2, rtol=2e-2)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        padding_rows_attention(q, k, v, out, num_valid, ranges)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[:, :, num_valid:], eager[:, :, num_valid:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tiles", [1, 2, 4])
def test_vision_attention_at_the_11b_shape(num_tiles: int) -> None:
    """Each tile count's path (4 tiles: the split kernel; fewer: two SDPA calls) against the
    dense-mask reference in fp32, bf16 inputs."""
    length, num_valid = 6432, 1601 * num_tiles
    q, k, v = _projected(1, length, 16, 80, torch.bfloat16, seed=7 + num_tiles)
    ranges = padding_rows_ranges(length, num_valid, DEVICE, split=True)
    assert (ranges is not None) == (num_tiles == 4)
    got = vision_attention(q, k, v, num_valid, ranges)
    torch.testing.assert_close(got.float(), _dense_mask_reference(q, k, v, num_valid),
                               atol=2e-2, rtol=2e-2)
