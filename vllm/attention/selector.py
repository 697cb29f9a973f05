"""Chooses the attention back-end for a device."""

from __future__ import annotations

import torch

from vllm import envs
from vllm.attention.backends.abstract import AttentionBackend
from vllm.attention.backends.torch_attn import TorchBackend


def get_attn_backend(device: torch.device) -> AttentionBackend:
    """TORCH on CPU; TRITON on CUDA unless ``VLLM_ATTENTION_BACKEND=TORCH``."""
    if device.type != "cuda" or envs.VLLM_ATTENTION_BACKEND == "TORCH":
        return TorchBackend()
    from vllm.attention.backends.triton_attn import TritonBackend  # needs Triton: CUDA only

    return TritonBackend()
