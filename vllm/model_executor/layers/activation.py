"""Gated activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.kernel_target import KernelTarget


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate|up projection output ([N, 2d]
    rows with the fused kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self._impl: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_ref

    def select_kernels(self, target: KernelTarget) -> None:
        self._impl = silu_and_mul_ref
        if target.fused:
            from vllm.model_executor.layers.fused_kernels import silu_and_mul

            self._impl = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._impl(x)
