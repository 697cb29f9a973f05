"""The CPU attention back-end: plain torch, also the oracle for the GPU kernels."""

from __future__ import annotations

import torch

from vllm.attention.metadata import AttentionMetadata
from vllm.attention.ops import reference as ref


class TorchReferenceBackend:
    """Straightforward torch implementations of every attention operation."""

    name = "TORCH_REF"
    fuses_rope = False  # the layer applies RoPE itself, then calls ``write_kv``

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        ref.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def prefill_self(self, query, key, value, md: AttentionMetadata, scale: float) -> torch.Tensor:
        assert md.seq_lens is not None
        return ref.varlen_causal_attention(query, key, value, md.seq_lens, scale)

    def decode_self(self, query, key_cache, value_cache, md: AttentionMetadata,
                    scale: float) -> torch.Tensor:
        return ref.paged_decode_attention(
            query, key_cache, value_cache, md.block_tables, md.seq_lens_tensor, scale)

    def prefill_cross(self, query, key, value, md: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        assert md.cross_range_runs is not None
        return ref.ranged_cross_attention(query, key, value, md.cross_range_runs, scale)

    def decode_cross(self, query, key_cache, value_cache, md: AttentionMetadata,
                     scale: float) -> torch.Tensor:
        assert md.cross_block_tables is not None and md.encoder_seq_lens_tensor is not None
        return ref.paged_decode_attention(
            query, key_cache, value_cache, md.cross_block_tables, md.encoder_seq_lens_tensor,
            scale)

    def warm_up_prefill(self, max_len, num_heads, num_kv_heads, head_dim, dtype, device,
                        cross_kv_lens) -> int:
        return 0  # plain torch on the CPU: nothing is planned per shape
