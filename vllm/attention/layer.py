"""Self- and cross-attention layers that read the step's metadata from the forward context.

The page-pool views a layer reads and writes are bound once by the cache engine
(``bind_kv_cache``); before that (the memory profile run) prefill runs without writing K/V.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.attention.backends.abstract import AttentionBackend
from vllm.forward_context import get_attention_metadata


class _PagedAttentionBase(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend: AttentionBackend | None = None

    def _views(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None):
        q = q.view(-1, self.num_heads, self.head_dim)
        if k is not None and v is not None:
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v


class Attention(_PagedAttentionBase):
    """Causal self-attention over the paged KV cache (GQA)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq * D], k/v: [T, Hkv * D] -> [T, Hq * D]
        md = get_attention_metadata()
        backend = self.backend
        assert backend is not None, "attention back-end not bound"
        q, k, v = self._views(q, k, v)
        if self.kv_cache is not None:
            backend.write_kv(k, v, self.kv_cache[0], self.kv_cache[1], md.slot_mapping)
        if md.is_prefill:
            out = backend.prefill_self(q, k, v, md, self.scale)
        else:
            assert self.kv_cache is not None, "decode needs a KV cache"
            out = backend.decode_self(q, self.kv_cache[0], self.kv_cache[1], md, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)


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
        if md.is_prefill:
            assert k is not None and v is not None, "prefill cross-attention needs vision K/V"
            if self.kv_cache is not None and md.cross_cache_src is not None:
                src = md.cross_cache_src
                backend.write_kv(k[src], v[src], self.kv_cache[0], self.kv_cache[1],
                                 md.cross_slot_mapping)
            out = backend.prefill_cross(q, k, v, md, self.scale)
        else:
            assert self.kv_cache is not None, "decode needs a cross KV cache"
            out = backend.decode_cross(q, self.kv_cache[0], self.kv_cache[1], md, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
