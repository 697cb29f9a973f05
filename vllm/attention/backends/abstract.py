"""The interface every attention back-end implements (torch reference on CPU, Triton on CUDA)."""

from __future__ import annotations

from typing import Protocol

import torch

from vllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Kernels behind the self- and cross-attention layers. Shapes are per token and head."""

    name: str

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
        md: AttentionMetadata, scale: float,
    ) -> torch.Tensor: ...

    def decode_self(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        md: AttentionMetadata, scale: float,
    ) -> torch.Tensor: ...

    def prefill_cross(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        md: AttentionMetadata, scale: float,
    ) -> torch.Tensor: ...

    def decode_cross(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        md: AttentionMetadata, scale: float,
    ) -> torch.Tensor: ...
