"""The interface every attention back-end implements (plain torch on CPU, Triton on CUDA)."""

from __future__ import annotations

from typing import Protocol

import torch

from vllm.attention.metadata import DecodeMetadata, PrefillMetadata


class AttentionBackend(Protocol):
    """Kernels behind the self- and cross-attention layers. Shapes are per token and head."""

    name: str
    # True when the back-end is also a ``RopeFusingBackend``: the self-attention layer then
    # hands it RoPE together with the KV write instead of rotating q/k in a launch of its own.
    fuses_rope: bool

    def write_kv(
        self,
        key: torch.Tensor,  # [N, Hkv, D]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_pages, Hkv, page_size, D]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [N] int64, -1 = padding
    ) -> None: ...

    def prefill_self(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        md: PrefillMetadata, scale: float,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,  # for chunks with context
    ) -> torch.Tensor: ...

    def decode_self(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        md: DecodeMetadata, scale: float,
    ) -> torch.Tensor: ...

    def prefill_cross(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        md: PrefillMetadata, scale: float,
    ) -> torch.Tensor: ...

    def decode_cross(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        md: DecodeMetadata, scale: float,
    ) -> torch.Tensor: ...


class RopeFusingBackend(AttentionBackend, Protocol):
    """A back-end that applies RoPE and writes the KV cache in one kernel (``fuses_rope``)."""

    def write_kv_rope(
        self,
        positions: torch.Tensor,  # [N], negative = padding
        query: torch.Tensor,  # [N, Hq, D], rotated in place
        key: torch.Tensor,  # [N, Hkv, D], rotated in place, then written
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_pages, Hkv, page_size, D]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [N] int64, -1 = padding (q/k still rotated)
        cos_cache: torch.Tensor,  # [max_position, D] float32
        sin_cache: torch.Tensor,
    ) -> None: ...
