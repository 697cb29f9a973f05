"""The CUDA attention back-end: Triton kernels for the KV write and paged decode, SDPA prefill.

Decode methods are captured in CUDA graphs: they read only device tensors and the static
configuration (never ``max_seq_len`` / ``max_encoder_seq_len``), branch on no tensor data, and
allocate only buffers whose shapes follow from the batch size and the model's head shape.
Prefill runs eagerly and may use host lengths to size its grid.
"""

from __future__ import annotations

import torch

from vllm.attention.metadata import ContextGroup, DecodeMetadata, PrefillMetadata
from vllm.attention.ops import sdpa
from vllm.attention.ops.triton_decode import DecodeConfig, paged_decode_attention
from vllm.attention.ops.triton_kv_write import rope_and_write_kv_cache, write_kv_cache
from vllm.attention.ops.triton_prefill import (
    default_prefill_config,
    ranged_cross_attention,
    split_count,
    split_counts,
)


class TritonBackend:
    """Triton kernels for the KV write and decode, SDPA for most prefills (same semantics as
    the TORCH back-end).

    Differences from the TORCH back-end that no caller can observe: padding slots (-1) write
    nothing at all (the torch write sends them into the null page, which nobody reads), and
    rows past a sequence's length are never read (the torch decode reads whole pages).
    """

    name = "TRITON"
    fuses_rope = True  # implements ``write_kv_rope`` (RoPE + KV write in one launch)

    def __init__(self, decode_config: DecodeConfig | None = None,
                 num_sms: int | None = None) -> None:
        # None: the per-dtype default (``default_decode_config``); static for the process,
        # so every captured graph and every eager step split the KV the same way.
        self.decode_config = decode_config
        # The GPU's SM count sizes the key splits of cross prefills (None: read from the
        # device on first use; tests pass an H200's 132 to take the split path on CPU).
        self._num_sms = num_sms

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
        md: PrefillMetadata,
        scale: float,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # query: [T, Hq, D], key/value: [T, Hkv, D] -> [T, Hq, D]. SDPA (cuDNN on Hopper)
        # measured faster than a Triton causal kernel (see ``ops/sdpa.py``); chunks with
        # context read their earlier tokens from the pages, a group of chunks at a time.
        return sdpa.varlen_causal_attention(query, key, value, md.seq_lens, scale,
                                            md.context_lens, md.context_groups, kv_cache,
                                            self._after_context)

    def _after_context(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       group: ContextGroup, scale: float, out: torch.Tensor) -> None:
        """A context group's queries in one call of the ranged kernel: each query sees the
        gathered keys [its chunk's first, its position], given by ``group.ranges`` (built
        once per step), with no mask and native GQA (SDPA with a mask and GQA would take its
        math path); key splits fill the GPU when the group has few queries."""
        if group.rows is None:  # one chunk: its rows are contiguous
            q0, q1 = group.runs[0][:2]
            q = query[q0:q1]
            ranged_cross_attention(q, k, v, group.ranges, scale, out=out[q0:q1],
                                   num_splits=self._cross_splits(q, k))
            return
        q = query.index_select(0, group.rows)
        o = ranged_cross_attention(q, k, v, group.ranges, scale,
                                   num_splits=self._cross_splits(q, k))
        out.index_copy_(0, group.rows, o)

    def decode_self(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: DecodeMetadata,
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
            kv_ids=md.kv_ids,
            config=self.decode_config,
        )

    def prefill_cross(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        md: PrefillMetadata,
        scale: float,
    ) -> torch.Tensor:
        # query: [T, Hq, D], key/value: [S, Hkv, D] packed vision tokens -> [T, Hq, D]
        assert md.cross_kv_ranges is not None
        splits = self._cross_splits(query, key)
        if splits == 1:
            assert md.cross_range_runs is not None
            return sdpa.ranged_cross_attention(query, key, value, md.cross_range_runs, scale)
        # Few queries over many vision tokens (one image prompt's text): SDPA runs one
        # program per (query tile, head) and leaves most SMs idle; the key-split kernel fills
        # them (H200, 128 x 6,404: see benchmarks/RESULTS.md).
        return ranged_cross_attention(query, key, value, md.cross_kv_ranges, scale,
                                      num_splits=splits)

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> list[int]:
        """Runs the ranged prefill kernel once at every key-split count a prefill can choose
        (``split_count``: from 1 up to the SMs over one query tile's heads), so that none is
        compiled in the middle of serving: each count is a separate Triton specialisation,
        0.2-0.7 s to compile cold (665 ms for the split kernel plus 216 ms for its merge,
        measured on the H200 at a second chat turn's first cached-prefix prefill). Which
        counts a served prompt reaches depends on its length and the step's other prompts, so
        the warm-up requests alone do not cover them. Returns the counts run."""
        if device.type != "cuda":
            return []
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        cfg = default_prefill_config(dtype)
        counts = split_counts(num_heads, self._num_sms)
        keys = 4 * cfg.block_n * counts[-1]  # enough keys for the most splits
        q = torch.zeros(cfg.block_m, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(keys, num_kv_heads, head_dim, dtype=dtype, device=device)
        ranges = torch.zeros(cfg.block_m, 2, dtype=torch.int32, device=device)
        ranges[:, 1] = keys
        for n in counts:
            ranged_cross_attention(q, kv, kv, ranges, 1.0, num_splits=n)
        return counts

    def _cross_splits(self, query: torch.Tensor, key: torch.Tensor) -> int:
        if self._num_sms is None:
            if not query.is_cuda:
                return 1
            self._num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        return split_count(query.shape[0], query.shape[1], key.shape[0], self._num_sms,
                           default_prefill_config(query.dtype))

    def decode_cross(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: DecodeMetadata,
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
            kv_ids=md.kv_ids,
            config=self.decode_config,
        )
