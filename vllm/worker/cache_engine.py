"""The KV page pool's memory: one buffer, two views (self pages and cross pages).

Buffer: ``[num_pages, page_elems]`` in the cache dtype (the model dtype, or one byte a value
with ``--kv-cache-dtype fp8``: ``attention/kv_cache_dtype.py``). Self view:
``[num_pages, num_self_layers, 2, num_kv_heads, block_size, head_dim]``; cross view:
``[num_pages, num_cross_layers, 2, num_kv_heads, cross_block_size, head_dim]`` over the same
bytes. A layer's K (or V) cache is the strided slice ``[num_pages, num_kv_heads, page, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.distributed.parallel_state import get_tp
from vllm.model_executor.models.mllama import MllamaForConditionalGeneration
from vllm.transformers_utils.config import MllamaSpec
from vllm.utils import to_device


@dataclass(frozen=True)
class PageLayout:
    """Sizes derived from the model and the block size."""

    num_self_layers: int
    num_cross_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cross_block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, spec: MllamaSpec, block_size: int, dtype: torch.dtype) -> PageLayout:
        t = spec.text
        n_self, n_cross = len(t.self_attention_layers), len(t.cross_attention_layers)
        # The cross page fits in a self page's bytes: 4 x block_size tokens for 11B/90B.
        cross_block = max(1, (n_self * block_size) // max(n_cross, 1))
        kv_heads = get_tp().part(t.num_key_value_heads, "KV heads")  # this rank's heads
        return cls(n_self, n_cross, kv_heads, t.head_dim, block_size, cross_block, dtype)

    def pages_for_tokens(self, n: int) -> int:
        return -(-n // self.block_size)

    def cross_pages_for_tokens(self, n: int) -> int:
        return -(-n // self.cross_block_size)

    @property
    def self_elems(self) -> int:
        return self.num_self_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def cross_elems(self) -> int:
        return (self.num_cross_layers * 2 * self.num_kv_heads * self.cross_block_size
                * self.head_dim)

    @property
    def page_elems(self) -> int:
        return max(self.self_elems, self.cross_elems)

    @property
    def page_bytes(self) -> int:
        return self.page_elems * torch.empty((), dtype=self.dtype).element_size()


class CacheEngine:
    """Allocates the page buffer and binds each attention layer to its views."""

    def __init__(self, layout: PageLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        # Zeroed once: the CPU reference reads whole pages, so stale slots must be finite.
        self.buffer = torch.zeros(num_pages, layout.page_elems, dtype=layout.dtype,
                                  device=device)
        lo = layout
        self.self_view = self.buffer[:, :lo.self_elems].view(
            num_pages, lo.num_self_layers, 2, lo.num_kv_heads, lo.block_size, lo.head_dim)
        self.cross_view = self.buffer[:, :lo.cross_elems].view(
            num_pages, lo.num_cross_layers, 2, lo.num_kv_heads, lo.cross_block_size, lo.head_dim)

    def bind(self, model: MllamaForConditionalGeneration) -> None:
        selfs, crosses = model.attention_layers()
        assert len(selfs) == self.layout.num_self_layers
        assert len(crosses) == self.layout.num_cross_layers
        for i, attn in enumerate(selfs):
            attn.kv_cache = (self.self_view[:, i, 0], self.self_view[:, i, 1])
        for i, attn in enumerate(crosses):
            attn.kv_cache = (self.cross_view[:, i, 0], self.cross_view[:, i, 1])

    @staticmethod
    def unbind(model: MllamaForConditionalGeneration) -> None:
        selfs, crosses = model.attention_layers()
        for attn in (*selfs, *crosses):
            attn.kv_cache = None

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole pages (every layer) src -> dst, e.g. a forked sibling's last page."""
        if not pairs:
            return
        src = to_device([s for s, _ in pairs], torch.int64, self.buffer.device)
        dst = to_device([d for _, d in pairs], torch.int64, self.buffer.device)
        # Bytes, not values: the CPU has no index_copy_ for the FP8 dtypes.
        raw = self.buffer.view(torch.uint8)
        raw.index_copy_(0, dst, raw.index_select(0, src))
