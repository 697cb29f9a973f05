"""Per-step attention metadata: one instance describes every attention layer's inputs for a step.

A step is either a prefill step (whole prompts, packed back to back; no chunking, no prefix
reuse) or a decode step (one token per sequence). Tensors live on the model's device; the
``int``/``list`` fields are host values the runner already holds, so nothing here needs a
device-to-host read. Under a CUDA graph the forward may only read host fields that are fixed
for the graph (see ``vllm/worker/cuda_graph.py``).

Caches are paged. Page ``0`` is the null page: it is never allocated, padding rows point their
block tables at it with length 0, and the CPU cache write diverts padding slots (``-1``) into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Inputs of the self- and cross-attention layers for one step."""

    is_prefill: bool
    num_seqs: int
    num_tokens: int
    # Self-attention.
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 writes nothing
    seq_lens_tensor: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    max_seq_len: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (decode); unused in prefill
    # Prefill only: the packed prompts.
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32
    seq_lens: list[int] | None = None  # host copy of the prompt lengths
    # Trailing rows outside every sequence (prefill_inputs.prefill_rows pads the step's rows).
    num_padding: int = 0
    # Cross-attention. encoder_seq_lens counts the cached vision tokens (last image group) per
    # sequence; 0 means the sequence has no image. max_encoder_seq_len == 0 skips the cross layers.
    encoder_seq_lens: list[int] | None = None
    encoder_seq_lens_tensor: torch.Tensor | None = None  # [num_seqs] int32
    max_encoder_seq_len: int = 0
    cross_block_tables: torch.Tensor | None = None  # [num_seqs, max_cross_blocks] int32
    # Prefill with images: the step's vision tokens are packed ([num_vision_tokens, ...]).
    cross_kv_ranges: torch.Tensor | None = None  # [num_tokens, 2] int32: [start, end) per query
    cross_range_runs: list[tuple[int, int, int, int]] | None = None  # host (q0, q1, kv0, kv1)
    cross_cache_src: torch.Tensor | None = None  # [num_cached] int64 rows of the packed tokens
    cross_slot_mapping: torch.Tensor | None = None  # [num_cached] int64 cross-cache slots

    @property
    def skip_cross_attention(self) -> bool:
        """Decided on the host integer alone, so a captured graph never branches on data."""
        return self.max_encoder_seq_len == 0

    def cross_row_mask(self) -> torch.Tensor:
        """[num_tokens, 1] bool: True where a token sees at least one vision token.

        Derived on the device (prefill: non-empty range; decode: encoder length > 0), so the
        same graph serves text-only and image rows.
        """
        if self.is_prefill:
            assert self.cross_kv_ranges is not None
            return (self.cross_kv_ranges[:, 1] > self.cross_kv_ranges[:, 0]).unsqueeze(-1)
        assert self.encoder_seq_lens_tensor is not None
        return (self.encoder_seq_lens_tensor > 0).unsqueeze(-1)
