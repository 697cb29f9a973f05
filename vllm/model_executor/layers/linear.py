"""Linear layers whose parameters know how to load checkpoint tensors (fused or not).

Fused layers hold several checkpoint matrices stacked along the output dimension (q|k|v,
gate|up); ``weight_loader(param, tensor, shard_id)`` copies one checkpoint tensor into its
rows, so loading streams tensor by tensor with no second copy of the layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape its parameter expects."""


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: object = None) -> None:
    """Copies ``loaded`` into ``param`` after checking the shape (dtype is converted)."""
    if param.shape != loaded.shape:
        raise WeightShapeError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with a loadable weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; ``out`` (optional, may be float32) receives the result
        rounded to x's dtype, as ``linear(x).float()`` would."""
        if self.bias is None and x.is_cuda:
            from vllm.model_executor.layers.skinny_gemm import skinny_gemm, tuned_config

            cfg = tuned_config(x, self.weight)
            if cfg is not None:  # decode-sized shapes where the Triton GEMM is faster
                return skinny_gemm(x, self.weight, cfg, out=out)
        y = F.linear(x, self.weight, self.bias)
        if out is None:
            return y
        return out.copy_(y)


class MergedLinear(Linear):
    """Several bias-free projections of the same input stacked into one weight.

    ``shard_names[i]`` names the checkpoint tensor that fills rows
    ``sum(sizes[:i]) : sum(sizes[:i+1])``.
    """

    def __init__(self, in_features: int, sizes: Sequence[int], shard_names: Sequence[str]) -> None:
        super().__init__(in_features, sum(sizes), bias=False)
        assert len(sizes) == len(shard_names)
        self.sizes = tuple(sizes)
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        self.shards = {name: (offsets[i], sizes[i]) for i, name in enumerate(shard_names)}
        self.weight.weight_loader = self._load_shard  # type: ignore[attr-defined]

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object) -> None:
        if shard_id not in self.shards:
            raise WeightShapeError(f"unknown shard {shard_id!r}")
        start, size = self.shards[shard_id]  # type: ignore[index]
        expected = (size, self.in_features)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(f"expected shape {expected}, got {tuple(loaded.shape)}")
        with torch.no_grad():
            param[start:start + size].copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)
