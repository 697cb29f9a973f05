"""RMSNorm with the reference's numerics: float32 statistics, weight applied in the input dtype.

With fused kernels (chosen at load, ``kernel_target.py``) the norm, the residual add before it
and a gated branch joining the residual are one Triton launch; otherwise plain torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllm.model_executor.layers.kernel_target import KernelTarget


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def masked_gate_ref(x: torch.Tensor, gate: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    """``gate * where(row_mask, x, 0)`` (rows [T, H], gate [1], row_mask [T, 1] bool).

    torch.where rather than a multiply by the mask, so a NaN in a masked row stays out."""
    return gate * torch.where(row_mask, x, torch.zeros_like(x))


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    ``forward(x)`` returns the norm of x. ``forward(x, residual)`` first forms
    ``residual = residual + x`` (rounded to the activation dtype, as the reference does) and
    returns ``(norm(residual), residual)``; the fused kernel updates the residual in place.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self._fused: Callable[..., torch.Tensor] | None = None  # fused_kernels.rms_norm

    def select_kernels(self, target: KernelTarget) -> None:
        self._fused = None
        if target.fused:
            from vllm.model_executor.layers.fused_kernels import rms_norm

            self._fused = rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fused = self._fused
        if fused is not None:
            if residual is None:  # per-head norms come as [T, H, D]: one launch for all
                shape = x.shape
                return fused(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
            return fused(x, self.weight, self.eps, residual), residual
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        residual = residual + x
        return rms_norm_ref(residual, self.weight, self.eps), residual

    def forward_gated(
        self, x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor, row_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += gate * where(row_mask, x, 0)``, then the norm of the residual (a
        gated cross-attention branch joining the residual stream; one fused launch)."""
        fused = self._fused
        if fused is not None:
            out = fused(x, self.weight, self.eps, residual, gate=gate, row_mask=row_mask)
            return out, residual
        return self.forward(masked_gate_ref(x, gate, row_mask), residual)


class MaskedGate(nn.Module):
    """``gate * where(row_mask, x, 0)``: a gated branch zeroed on rows that see no image."""

    def __init__(self) -> None:
        super().__init__()
        self._impl: Callable[..., torch.Tensor] = masked_gate_ref

    def select_kernels(self, target: KernelTarget) -> None:
        self._impl = masked_gate_ref
        if target.fused:
            from vllm.model_executor.layers.fused_kernels import gate_rows

            self._impl = gate_rows

    def forward(self, x: torch.Tensor, gate: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
        return self._impl(x, gate, row_mask)
