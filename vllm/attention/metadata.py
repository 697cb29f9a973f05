"""Per-step attention metadata: one instance describes every attention layer's inputs for a step.

A step runs a decode (one token per sequence) and a prefill (prompts or chunks of prompts
packed back to back; a chunk continues tokens already in the cache), each with its own type:

* :class:`DecodeMetadata` is what a captured decode graph reads: device tensors and integers
  fixed for the graph (its static maxima), nothing else. The type checks that on construction,
  so a host list can never reach captured code.
* :class:`PrefillMetadata` (eager, never captured) also carries host values the runner already
  holds (prompt lengths, the runs of queries that share a vision range) that size its loops.

Caches are paged. Page ``0`` is the null page: it is never allocated, padding rows point their
block tables at it with length 0, and the CPU cache write diverts padding slots (``-1``) into it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch


@dataclass(frozen=True)
class DecodeMetadata:
    """Inputs of the self- and cross-attention layers for a decode step."""

    is_prefill: ClassVar[bool] = False

    slot_mapping: torch.Tensor  # [B] int64; -1 writes nothing (padding rows)
    seq_lens_tensor: torch.Tensor  # [B] int32: context length including this step's token
    block_tables: torch.Tensor  # [B, W] int32
    # Cached vision tokens (the last image group) per sequence; 0: the sequence has no image.
    encoder_seq_lens_tensor: torch.Tensor  # [B] int32
    cross_block_tables: torch.Tensor  # [B, Wc] int32
    # [B] int32: rows with equal ids are one sequence's row chunk (the same pages), which the
    # decode kernel may serve from one read; distinct for distinct sequences.
    kv_ids: torch.Tensor
    max_seq_len: int  # static for a graph (max_model_len); never read by the kernels
    # 0 skips the cross layers (the text graph family); a graph bakes it in at capture.
    max_encoder_seq_len: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind = torch.Tensor if f.type == "torch.Tensor" else int
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TypeError(
                    f"DecodeMetadata.{f.name} must be a {kind.__name__} (captured "
                    f"code reads only device tensors and capture-time integers), "
                    f"got {type(value).__name__}"
                )

    @property
    def num_seqs(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def skip_cross_attention(self) -> bool:
        """Decided on the capture-time integer alone: a graph never branches on data."""
        return self.max_encoder_seq_len == 0

    def cross_row_mask(self) -> torch.Tensor:
        """[B, 1] bool: True where the sequence has an image (derived on the device, so one
        graph serves text-only and image rows)."""
        return (self.encoder_seq_lens_tensor > 0).unsqueeze(-1)


@dataclass(frozen=True)
class ContextGroup:
    """Prefill chunks of one step whose earlier tokens (their context) are read from the
    pages together: one gather of all their pages per layer, then one attention call where
    the back-end has a kernel for it (``ops/sdpa.py``). A step with many short chunks after
    a cached prefix (a chat template's system header, say) then costs a few launches per
    layer, not a few per chunk.

    Gathered key row ``r`` is token ``r % page_size`` of page ``pages[r // page_size]``.
    Each chunk's keys start on a page boundary of the gather, so the tail of its last page
    holds rows that no query sees."""

    pages: torch.Tensor  # [n] int64: each chunk's pages (positions 0..its end), chunk after chunk
    # Host, per chunk: step rows q0..q1 are its queries, the last q1 - q0 of gathered keys k0..k1.
    runs: list[tuple[int, int, int, int]]
    # [Tq, 2] int32 per query of the chunks (in ``runs`` order): gathered keys [start, end).
    ranges: torch.Tensor
    # [Tq] int64: the step rows of those queries; None when the group is one chunk (q0..q1).
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillMetadata:
    """Inputs of the self- and cross-attention layers for a prefill step (run eagerly)."""

    is_prefill: ClassVar[bool] = True

    num_tokens: int  # rows of the step, padding rows included
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 writes nothing
    seq_lens: list[int]  # host token counts of the step's sequences, packed from row 0
    # Trailing rows outside every sequence (prefill_inputs.prefill_rows pads the step's rows).
    num_padding: int = 0
    # Cached vision tokens of the longest last image group; 0 skips the cross layers.
    max_encoder_seq_len: int = 0
    # The step's vision tokens are packed ([num_vision_tokens, ...]); each query sees one range.
    cross_kv_ranges: torch.Tensor | None = None  # [num_tokens, 2] int32: [start, end)
    cross_range_runs: list[tuple[int, int, int, int]] | None = None  # host (q0, q1, kv0, kv1)
    cross_cache_src: torch.Tensor | None = None  # [num_cached] int64 rows of the packed tokens
    cross_slot_mapping: torch.Tensor | None = None  # [num_cached] int64 cross-cache slots
    # Cross-cache slots whose K/V (cached cross groups) follow the step's fresh vision K/V.
    cross_cache_read: torch.Tensor | None = None  # [num_read] int64
    # Prefill chunks: per sequence, the tokens before this step's (their K/V in its pages),
    # and the chunks with any, grouped for reading those pages (bounded in pages per group).
    context_lens: list[int] | None = None
    context_groups: list[ContextGroup] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def skip_cross_attention(self) -> bool:
        return self.max_encoder_seq_len == 0

    def cross_row_mask(self) -> torch.Tensor:
        """[num_tokens, 1] bool: True where a token sees at least one vision token."""
        assert self.cross_kv_ranges is not None
        return (self.cross_kv_ranges[:, 1] > self.cross_kv_ranges[:, 0]).unsqueeze(-1)


AttentionMetadata = PrefillMetadata | DecodeMetadata
