"""The CPU attention back-end: plain torch (SDPA prefill, torch paged decode and KV write)."""

from __future__ import annotations

import torch

from vllm.attention.metadata import DecodeMetadata, PrefillMetadata
from vllm.attention.ops import sdpa, torch_paged


class TorchBackend:
    """Every attention operation in plain torch; runs wherever torch does."""

    name = "TORCH"
    fuses_rope = False  # the layer applies RoPE itself, then calls ``write_kv``

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        torch_paged.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def prefill_self(
        self, query, key, value, md: PrefillMetadata, scale: float, kv_cache=None
    ) -> torch.Tensor:
        return sdpa.varlen_causal_attention(
            query, key, value, md.seq_lens, scale, md.context_lens, md.context_groups, kv_cache
        )

    def decode_self(
        self, query, key_cache, value_cache, md: DecodeMetadata, scale: float
    ) -> torch.Tensor:
        return torch_paged.paged_decode_attention(
            query, key_cache, value_cache, md.block_tables, md.seq_lens_tensor, scale
        )

    def prefill_cross(self, query, key, value, md: PrefillMetadata, scale: float) -> torch.Tensor:
        assert md.cross_range_runs is not None
        return sdpa.ranged_cross_attention(query, key, value, md.cross_range_runs, scale)

    def decode_cross(
        self, query, key_cache, value_cache, md: DecodeMetadata, scale: float
    ) -> torch.Tensor:
        assert md.cross_block_tables is not None and md.encoder_seq_lens_tensor is not None
        return torch_paged.paged_decode_attention(
            query, key_cache, value_cache, md.cross_block_tables, md.encoder_seq_lens_tensor, scale
        )
