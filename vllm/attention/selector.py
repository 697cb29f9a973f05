"""Chooses the attention back-end for a device (override with ``VLLM_ATTENTION_BACKEND``;
``VLLM_PREFILL_ATTENTION`` picks the CUDA back-end's prefill kernels: ``sdpa`` (default),
``sdpa_buckets`` or ``triton``, see ``TritonBackend``)."""

from __future__ import annotations

import os

import torch

from vllm.attention.backends.abstract import AttentionBackend
from vllm.attention.backends.torch_ref import TorchReferenceBackend


def get_attn_backend(device: torch.device) -> AttentionBackend:
    """TORCH_REF on CPU; TRITON on CUDA unless ``VLLM_ATTENTION_BACKEND=TORCH_REF``."""
    name = os.environ.get("VLLM_ATTENTION_BACKEND", "")
    if device.type != "cuda" or name == "TORCH_REF":
        return TorchReferenceBackend()
    from vllm.attention.backends.triton_attn import PREFILL_CHOICES, TritonBackend

    prefill = os.environ.get("VLLM_PREFILL_ATTENTION", "sdpa")
    if prefill not in PREFILL_CHOICES:
        raise ValueError(f"VLLM_PREFILL_ATTENTION must be one of {PREFILL_CHOICES}, "
                         f"got {prefill!r}")
    return TritonBackend(prefill=prefill)
