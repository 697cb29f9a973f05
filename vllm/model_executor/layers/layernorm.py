"""RMSNorm with the reference's numerics: float32 statistics, weight applied in the input dtype.

On CUDA the norm (and the residual add before it) is one Triton kernel; elsewhere plain torch.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    ``forward(x)`` returns the norm of x. ``forward(x, residual)`` first forms
    ``residual = residual + x`` (rounded to the activation dtype, as the reference does) and
    returns ``(norm(residual), residual)``; on CUDA the residual is updated in place.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:
            from vllm.model_executor.layers.fused_kernels import rms_norm

            if residual is None:  # per-head norms come as [T, H, D]: one launch for all
                shape = x.shape
                return rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
            out = rms_norm(x, self.weight, self.eps, residual)
            return out, residual
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        residual = residual + x
        return rms_norm_ref(residual, self.weight, self.eps), residual

    def forward_gated(self, x: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor,
                      row_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += gate * where(row_mask, x, 0)``, then the norm of the residual (a
        gated cross-attention branch joining the residual stream; one launch on CUDA)."""
        if x.is_cuda:
            from vllm.model_executor.layers.fused_kernels import rms_norm

            out = rms_norm(x, self.weight, self.eps, residual, gate=gate, row_mask=row_mask)
            return out, residual
        return self.forward(masked_gate(x, gate, row_mask), residual)


def masked_gate(x: torch.Tensor, gate: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    """``gate * where(row_mask, x, 0)`` (rows [T, H], gate [1], row_mask [T, 1] bool).

    torch.where rather than a multiply by the mask, so a NaN in a masked row stays out."""
    if x.is_cuda:
        from vllm.model_executor.layers.fused_kernels import gate_rows

        return gate_rows(x, gate, row_mask)
    return gate * torch.where(row_mask, x, torch.zeros_like(x))
