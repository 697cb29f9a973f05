"""Chooses the attention back-end for a device (override with ``VLLM_ATTENTION_BACKEND``)."""

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
    from vllm.attention.backends.triton_attn import TritonBackend

    return TritonBackend()
