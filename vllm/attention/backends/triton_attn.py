"""The CUDA attention back-end: Triton kernels for the KV write, prefill and paged decode.

Decode methods are captured in CUDA graphs: they read only device tensors and the static
configuration (never ``max_seq_len`` / ``max_encoder_seq_len``), branch on no tensor data, and
allocate only buffers whose shapes follow from the batch size and the model's head shape.
Prefill runs eagerly and may use host lengths to size its grid.
"""

from __future__ import annotations

import torch

from vllm.attention.metadata import AttentionMetadata
from vllm.attention.ops import reference as ref
from vllm.attention.ops import sdpa_prefill
from vllm.attention.ops.triton_decode import DecodeConfig, paged_decode_attention
from vllm.attention.ops.triton_kv_write import rope_and_write_kv_cache, write_kv_cache
from vllm.attention.ops.triton_prefill import (
    default_prefill_config,
    ranged_cross_attention,
    split_count,
    varlen_causal_attention,
)
from vllm.utils import to_device

PREFILL_CHOICES = ("sdpa", "sdpa_buckets", "triton")


class TritonBackend:
    """Triton implementations of every attention operation (same semantics as TORCH_REF).

    Differences from the reference that no caller can observe: padding slots (-1) write
    nothing at all (the reference writes them into the null page, which nobody reads), and
    rows past a sequence's length are never read (the reference reads whole pages).
    """

    name = "TRITON"
    fuses_rope = True  # implements ``write_kv_rope`` (RoPE + KV write in one launch)

    def __init__(self, decode_config: DecodeConfig | None = None,
                 prefill: str = "sdpa") -> None:
        # None: the per-dtype default (``default_decode_config``); static for the process,
        # so every captured graph and every eager step split the KV the same way.
        self.decode_config = decode_config
        # Prefill kernel: torch SDPA (cuDNN on Hopper) measured faster than our Triton
        # kernels on the H200 (8k causal GQA: 0.92 vs 1.35 ms; 1k x 6404 ranged cross:
        # 0.19 vs 0.31 ms), so it is the default; "sdpa_buckets" pads prompt lengths to a
        # bounded set of shapes whose cuDNN plans the warm-up builds (``sdpa_prefill``; a
        # new shape costs ~40 ms of planning); "triton" keeps the Triton kernels. Cross
        # prefills too small to fill the GPU take the key-split Triton kernel either way.
        if prefill not in PREFILL_CHOICES:
            raise ValueError(f"prefill must be one of {PREFILL_CHOICES}, got {prefill!r}")
        self.prefill = prefill
        self._num_sms: int | None = None

    def write_kv(
        self,
        key: torch.Tensor,  # [N, Hkv, D]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_pages, Hkv, page_size, D]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [N] int64, -1 = padding
    ) -> None:
        write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def write_kv_rope(
        self,
        positions: torch.Tensor,  # [N]
        query: torch.Tensor,  # [N, Hq, D], rotated in place
        key: torch.Tensor,  # [N, Hkv, D], rotated in place
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_pages, Hkv, page_size, D]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [N] int64, -1 = padding
        cos_cache: torch.Tensor,  # [max_position, D] float32
        sin_cache: torch.Tensor,
    ) -> None:
        rope_and_write_kv_cache(positions, query, key, value, cos_cache, sin_cache, key_cache,
                                value_cache, slot_mapping)

    def prefill_self(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # query: [T, Hq, D], key/value: [T, Hkv, D] -> [T, Hq, D]
        assert md.seq_lens is not None
        if self.prefill == "sdpa":
            return ref.varlen_causal_attention(query, key, value, md.seq_lens, scale)
        if self.prefill == "sdpa_buckets":
            return sdpa_prefill.causal_attention(query, key, value, md.seq_lens, scale)
        query_start_loc = md.query_start_loc
        if query_start_loc is None:
            starts = [0]
            for n in md.seq_lens:
                starts.append(starts[-1] + n)
            query_start_loc = to_device(starts, torch.int32, query.device)
        return varlen_causal_attention(
            query, key, value, query_start_loc, max(md.seq_lens, default=0), scale
        )

    def warm_up_prefill(self, max_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, device: torch.device,
                        cross_kv_lens: list[int]) -> int:
        """Builds the SDPA plans of every prefill length bucket up to ``max_len`` (self and
        cross over each vision length in ``cross_kv_lens``); returns the number of calls."""
        if self.prefill != "sdpa_buckets":
            return 0
        return sdpa_prefill.warm_up_plans(max_len, num_heads, num_kv_heads, head_dim, dtype,
                                          device, cross_kv_lens)

    def decode_self(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # query: [B, Hq, D] -> [B, Hq, D]
        return paged_decode_attention(
            query,
            key_cache,
            value_cache,
            md.block_tables,
            md.seq_lens_tensor,
            scale,
            config=self.decode_config,
        )

    def prefill_cross(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # query: [T, Hq, D], key/value: [S, Hkv, D] packed vision tokens -> [T, Hq, D]
        assert md.cross_kv_ranges is not None
        splits = self._cross_splits(query, key)
        if self.prefill != "triton" and splits == 1:
            assert md.cross_range_runs is not None
            attend = (sdpa_prefill.ranged_cross_attention if self.prefill == "sdpa_buckets"
                      else ref.ranged_cross_attention)
            return attend(query, key, value, md.cross_range_runs, scale)
        if key.shape[0] == 0:  # host shape: no vision token in the step
            return torch.zeros_like(query)
        # Few queries over many vision tokens (one image prompt's text): SDPA and the
        # unsplit kernel run one program per (query tile, head) and leave most SMs idle; the
        # key-split kernel fills them (H200, 128 x 6,404: see benchmarks/RESULTS.md).
        return ranged_cross_attention(query, key, value, md.cross_kv_ranges, scale,
                                      num_splits=splits)

    def _cross_splits(self, query: torch.Tensor, key: torch.Tensor) -> int:
        if not query.is_cuda:
            return 1
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        return split_count(query.shape[0], query.shape[1], key.shape[0], self._num_sms,
                           default_prefill_config(query.dtype))

    def decode_cross(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # query: [B, Hq, D] -> [B, Hq, D]; rows with encoder length 0 give zeros
        assert md.cross_block_tables is not None and md.encoder_seq_lens_tensor is not None
        return paged_decode_attention(
            query,
            key_cache,
            value_cache,
            md.cross_block_tables,
            md.encoder_seq_lens_tensor,
            scale,
            config=self.decode_config,
        )
