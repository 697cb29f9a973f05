"""Rotary position embeddings with Llama 3 frequency scaling.

cos/sin are precomputed in float32 for every position up to ``max_position`` and cast to the
activation dtype when applied, which reproduces the reference's numerics exactly. With fused
kernels the rotation is one Triton launch (or part of the KV-cache write, ``attention/layer.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from vllm.model_executor.layers.kernel_target import KernelTarget
from vllm.transformers_utils.config import RopeSpec


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the ``llama3`` long-context adjustment."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads in the neox (half-split) layout."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeSpec) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
        self._inplace: Callable[..., None] | None = None  # fused_kernels.rotary_inplace

    def select_kernels(self, target: KernelTarget) -> None:
        self._inplace = None
        if target.fused:
            from vllm.model_executor.layers.fused_kernels import rotary_inplace

            self._inplace = rotary_inplace

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq * D]; k: [T, Hkv * D]
        if self._inplace is not None:  # one launch, q and k rotated in place
            self._inplace(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim)
            return q, k
        t = positions.shape[0]
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        qh = q.view(t, -1, self.head_dim)
        kh = k.view(t, -1, self.head_dim)
        q_out = qh * cos + _rotate_half(qh) * sin
        k_out = kh * cos + _rotate_half(kh) * sin
        return q_out.reshape(q.shape), k_out.reshape(k.shape)
