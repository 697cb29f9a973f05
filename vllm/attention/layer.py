"""Self- and cross-attention layers that read the step's metadata from the forward context.

The page-pool views a layer reads and writes are bound once by the cache engine
(``bind_kv_cache``); before that (the memory profile run) prefill runs without writing K/V.
With an FP8 cache, prefill attends to its fresh K/V rounded as the cache stores them
(``kv_cache_dtype``), so prefill and decode read the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend, RopeFusingBackend
from vllm.attention.kv_cache_dtype import round_kv
from vllm.attention.metadata import AttentionMetadata, PrefillMetadata
from vllm.forward_context import get_attention_metadata

if TYPE_CHECKING:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


class _PagedAttentionBase(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend: AttentionBackend | None = None

    def _as_cached(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh K/V as a read of the bound cache would see them: rounded through an FP8
        cache (``kv_cache_dtype.round_kv``), unchanged otherwise or when unbound."""
        if self.kv_cache is None:
            return k, v
        dtype = self.kv_cache[0].dtype
        return round_kv(k, dtype), round_kv(v, dtype)

    def _views(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None):
        q = q.view(-1, self.num_heads, self.head_dim)
        if k is not None and v is not None:
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v


class Attention(_PagedAttentionBase):
    """Causal self-attention over the paged KV cache (GQA)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None,
                rotary: RotaryEmbedding | None = None) -> torch.Tensor:
        """q: [T, Hq * D], k/v: [T, Hkv * D] (rows may be strided) -> [T, Hq * D].

        With ``rotary`` (and ``positions``, [T]) q and k are rotated first; a back-end that
        ``fuses_rope`` does it in the KV-write launch (in place, so prefill reads rotated q/k).
        """
        md = get_attention_metadata()
        backend = self.backend
        assert backend is not None, "attention back-end not bound"
        q, k, v = self._rope_and_write(backend, md, q, k, v, positions, rotary)
        if isinstance(md, PrefillMetadata):
            k, v = self._as_cached(k, v)
            out = backend.prefill_self(q, k, v, md, self.scale, self.kv_cache)
            if md.num_padding:
                # The back-ends leave rows outside every sequence unwritten: zeroed, the
                # padding rows stay finite through the layers, so no NaN of stale memory
                # reaches a cache (the reference write sends them to the null page).
                out[-md.num_padding:].zero_()
        else:
            assert self.kv_cache is not None, "decode needs a KV cache"
            out = backend.decode_self(q, self.kv_cache[0], self.kv_cache[1], md, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _rope_and_write(
        self, backend: AttentionBackend, md: AttentionMetadata, q: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
        rotary: RotaryEmbedding | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q/k (if ``rotary``) and writes K/V (if the cache is bound); returns the
        [T, H, D] views attention reads. Unbound (the profile run) it only rotates."""
        fused = rotary is not None and self.kv_cache is not None and backend.fuses_rope
        if rotary is not None and not fused:
            assert positions is not None, "RoPE needs positions"
            q, k = rotary(positions, q, k)
        q, k, v = self._views(q, k, v)
        if self.kv_cache is None:
            return q, k, v
        if fused:
            assert rotary is not None and positions is not None, "RoPE needs positions"
            # One launch instead of two: a decode step is a graph of hundreds of tiny kernels.
            cast(RopeFusingBackend, backend).write_kv_rope(
                positions, q, k, v, self.kv_cache[0], self.kv_cache[1], md.slot_mapping,
                rotary.cos_cache, rotary.sin_cache)
        else:
            backend.write_kv(k, v, self.kv_cache[0], self.kv_cache[1], md.slot_mapping)
        return q, k, v


class CrossAttention(_PagedAttentionBase):
    """Attention from text tokens to vision tokens.

    Prefill receives the step's packed vision K/V, attends within each query's range, and
    caches the rows of every request's last image group. Decode reads the cached rows only.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None,
                v: torch.Tensor | None = None) -> torch.Tensor:
        md = get_attention_metadata()
        backend = self.backend
        assert backend is not None, "attention back-end not bound"
        q, k, v = self._views(q, k, v)
        if isinstance(md, PrefillMetadata):
            if self.kv_cache is not None and md.cross_cache_src is not None:
                assert k is not None and v is not None
                src = md.cross_cache_src
                backend.write_kv(k[src], v[src], self.kv_cache[0], self.kv_cache[1],
                                 md.cross_slot_mapping)
            if k is not None and v is not None:
                k, v = self._as_cached(k, v)
            if md.cross_cache_read is not None:
                k, v = self._with_cached(k, v, md.cross_cache_read, q.dtype)
            assert k is not None and v is not None, "prefill cross-attention needs vision K/V"
            out = backend.prefill_cross(q, k, v, md, self.scale)
        else:
            assert self.kv_cache is not None, "decode needs a cross KV cache"
            out = backend.decode_cross(q, self.kv_cache[0], self.kv_cache[1], md, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _with_cached(self, k: torch.Tensor | None, v: torch.Tensor | None,
                     slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's fresh vision K/V followed by the cached rows at ``slots``, in
        ``dtype`` (an FP8 cache's rows are widened)."""
        assert self.kv_cache is not None, "reading cached cross K/V needs the cache"
        key_cache, value_cache = self.kv_cache  # [num_pages, Hkv, page_size, D]
        page_size = key_cache.shape[2]
        pages, offsets = slots // page_size, slots % page_size
        kc = key_cache[pages, :, offsets].to(dtype)  # [N, Hkv, D]
        vc = value_cache[pages, :, offsets].to(dtype)
        if k is None or v is None:
            return kc, vc
        return torch.cat([k, kc]), torch.cat([v, vc])
