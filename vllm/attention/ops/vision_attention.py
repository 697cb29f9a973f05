"""Attention of the vision tower: valid queries see every key, padding queries the valid keys.

The vision tower attends bidirectionally over an image's tokens, valid tokens first (see
``mllama_vision``): valid queries see every key (padding included), padding queries only the
valid keys. Two shapes of that problem, two ways (per layer on the H200, 16 heads of 80):
- few padding rows (a 4-tile image: 28 of 6,432): one maskless SDPA over all tokens, then the
  padding rows redone over the valid keys. SDPA runs those 28 rows as one program per head
  (16 of 132 SMs; 89 us), so on CUDA they go through the ranged cross-attention kernel with
  the keys split over programs instead (flash-decoding style; 18 us);
- many padding rows (fewer tiles: a 1-tile image has 4,831): the valid rows over all keys and
  the padding rows over the valid keys as two SDPA calls, joined (308 us against 738 us for
  the maskless call over all 6,432 rows plus the padding rows).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:  # Triton is imported on first use: CPU installs do not have it
    from vllm.attention.ops.triton_prefill import PrefillConfig

# cuDNN's attention is the fastest SDPA back-end for these shapes on Hopper (head_dim 80).
_CUDA_SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Padding rows up to this many per image take the split kernel (one query tile); more (images
# with fewer tiles than the maximum: thousands of padding rows) keep SDPA, which is compute-
# efficient there.
MAX_SPLIT_PADDING_ROWS = 64
# Half precision: a 64-row query tile (a 4-tile image has 28 padding rows), as
# (block_m, block_n, num_warps, num_stages) of a ``PrefillConfig``; the fastest of a sweep
# on the H200 (17.7 us at 16 splits; 32-row tiles 19.6, 128-row 29.1).
HALF_PADDING_TILE = (64, 64, 4, 3)
# Key splits per (query tile, head) relative to ``split_count``'s one wave of programs.
SPLIT_WAVES = 2


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Maskless SDPA ([G, H, L, D]); on CUDA with cuDNN's kernel first."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(_CUDA_SDPA_ORDER, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_valid: int,
                     pad_ranges: torch.Tensor | None) -> torch.Tensor:
    """q, k, v: [G, H, L, D] (views of a [G, L, H, D] projection), the first ``num_valid``
    tokens valid; ``pad_ranges`` from ``padding_rows_ranges`` -> [G, L, H * D]."""
    g, _, length, _ = q.shape
    if num_valid < length and pad_ranges is None:
        valid = sdpa(q[:, :, :num_valid], k, v)
        pad = sdpa(q[:, :, num_valid:], k[:, :, :num_valid], v[:, :, :num_valid])
        out = torch.cat((valid.transpose(1, 2), pad.transpose(1, 2)), dim=1)
        return out.reshape(g, length, -1)
    out = sdpa(q, k, v)
    if num_valid < length:
        padding_rows_attention(q, k, v, out, num_valid, pad_ranges)
    return out.transpose(1, 2).reshape(g, length, -1)


def padding_rows_ranges(num_tokens: int, num_valid: int, device: torch.device,
                        split: bool = True) -> torch.Tensor | None:
    """The key range of every padding row for the split kernel ([P, 2] int32, all
    ``[0, num_valid)``), or None where SDPA does them (``split`` off: no Triton kernels; no
    padding; or too many rows). Built with device kernels only, so it can be captured."""
    num_pad = num_tokens - num_valid
    if not split or not 0 < num_pad <= MAX_SPLIT_PADDING_ROWS:
        return None
    ranges = torch.zeros(num_pad, 2, dtype=torch.int32, device=device)
    ranges[:, 1] = num_valid
    return ranges


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def padding_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, num_valid: int, ranges: torch.Tensor,
                           *, config: PrefillConfig | None = None,
                           num_splits: int | None = None) -> None:
    """Writes ``out[:, :, num_valid:]``: the padding queries attending the valid keys only.

    ``q``, ``k``, ``v``, ``out``: [G, H, L, D] with unit last stride (views of a [G, L, H, D]
    projection are fine); ``ranges`` from ``padding_rows_ranges``. One kernel call per image
    (an image's keys are a strided slice of the projection; images are few per step)."""
    from vllm.attention.ops.triton_prefill import (
        FP32_PREFILL_CONFIG,
        PrefillConfig,
        ranged_cross_attention,
        split_count,
    )

    g, heads, length, head_dim = q.shape
    num_pad = length - num_valid
    assert ranges.shape == (num_pad, 2)
    if config is None:
        config = (PrefillConfig(*HALF_PADDING_TILE) if q.dtype != torch.float32
                  else FP32_PREFILL_CONFIG)
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if q.is_cuda else 1
        num_splits = split_count(num_pad, heads, num_valid, SPLIT_WAVES * sms, config)
    for i in range(g):
        qi, ki, vi, oi = (t[i].transpose(0, 1) for t in (q, k, v, out))  # [L, H, D] views
        ranged_cross_attention(qi[num_valid:], ki[:num_valid], vi[:num_valid], ranges,
                               head_dim**-0.5, out=oi[num_valid:], config=config,
                               num_splits=num_splits)
