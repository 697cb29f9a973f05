"""Linear layers: a storage format that owns the parameters, and a kernel table chosen at load.

A :class:`LinearFormat` decides how a layer's weight is stored (unquantized in the model dtype
here; bitsandbytes 4-bit in ``quantization/bitsandbytes.py``, FP8 in ``quantization/fp8.py``,
chosen per layer by a ``QuantizationConfig`` when the model is built), registers the
parameters with their checkpoint loaders, and builds the layer's kernel table for a
:class:`KernelTarget`: one kernel per decode row bucket, then one for any row count (see
``kernel_target.py``). ``Linear.forward`` only indexes that table with the step's bucket.

Fused layers (:class:`MergedLinear`) hold several checkpoint matrices stacked along the output
dimension (q|k|v, gate|up): one matrix, one launch. ``weight_loader(param, tensor, shard_id)``
copies one checkpoint tensor into its rows, so loading streams tensor by tensor with no second
copy of the layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vllm.forward_context import row_bucket
from vllm.model_executor.layers.kernel_target import KernelTarget

# kernel(x [M, K], out [M, N] or None) -> y [M, N]; ``out`` may be float32 and then receives the
# result rounded to x's dtype, as ``linear(x).float()`` would give.
LinearKernel = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
# kernel(x [M, K]) -> silu(x @ gate^T) * (x @ up^T) for a gate|up layer.
SiluKernel = Callable[[torch.Tensor], torch.Tensor]


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape its parameter expects."""


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None
) -> None:
    """Copies ``loaded`` into ``param`` after checking the shape (dtype is converted)."""
    _check_plain(loaded)
    if param.shape != loaded.shape:
        raise WeightShapeError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_plain(loaded: object) -> None:
    if not isinstance(loaded, torch.Tensor):
        raise WeightShapeError(
            f"expected a plain tensor, got {type(loaded).__name__} (a quantized matrix for a "
            "parameter that is not stored quantized)"
        )
    if loaded.dtype in FP8_DTYPES:
        raise WeightShapeError(
            f"got a {loaded.dtype} tensor for a layer that is not stored in FP8 (the "
            "checkpoint's quantization_config ignores it, or names no FP8 scheme for it)"
        )


class LinearFormat(ABC):
    """How a linear layer stores its weight and which kernels apply it."""

    name: str

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Registers the layer's parameters (with their ``weight_loader``s) on ``layer``."""

    @abstractmethod
    def build_kernels(self, layer: Linear, target: KernelTarget) -> list[LinearKernel]:
        """One kernel per ``target.row_buckets`` entry, then one for any row count."""

    def build_silu_kernels(self, layer: Linear, target: KernelTarget) -> list[SiluKernel | None]:
        """For a gate|up layer: a kernel with the SiLU-and-multiply in its epilogue per row
        bucket (None where the GEMM and a separate activation are used); same indexing."""
        return [None] * (len(target.row_buckets) + 1)

    def torch_kernel(self, layer: Linear) -> LinearKernel:
        """The kernel a layer runs before ``select_kernels`` (plain torch, any device)."""
        return _torch_linear(layer)

    def compute_dtype(self, layer: Linear) -> torch.dtype:
        """The dtype of the layer's inputs and outputs."""
        return layer.weight.dtype


def _torch_linear(layer: Linear) -> LinearKernel:
    def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, layer.weight, layer.bias)
        return y if out is None else out.copy_(y)

    return run


def _cublaslt_linear(layer: Linear) -> LinearKernel:
    """``F.linear`` through cuBLASLt: at decode row counts (up to 64 measured) its heuristics
    stream the MLP weights 3-12% faster than cuBLAS's and skip the down projection's split-K
    reduction kernel (H200, see benchmarks/RESULTS.md). The library choice is process-wide in
    torch, so it is set around the call and restored."""

    def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            y = F.linear(x, layer.weight, layer.bias)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
        return y if out is None else out.copy_(y)

    return run


class UnquantizedFormat(LinearFormat):
    """The weight as one [out, in] matrix in the model dtype (and an optional bias)."""

    name = "unquantized"

    def create_weights(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features), requires_grad=False
        )
        layer.bias = (
            nn.Parameter(torch.empty(layer.out_features), requires_grad=False)
            if layer.has_bias
            else None
        )
        if layer.shards:
            layer.weight.weight_loader = layer.load_shard  # type: ignore[attr-defined]

    def build_kernels(self, layer: Linear, target: KernelTarget) -> list[LinearKernel]:
        plain = _torch_linear(layer)
        if not target.fused:
            return [plain] * (len(target.row_buckets) + 1)
        from vllm.model_executor.layers import skinny_gemm as sg  # Triton: fused targets only

        n, k = layer.weight.shape
        decode_default = _cublaslt_linear(layer) if target.cuda else plain
        table: list[LinearKernel] = []
        for rows in target.row_buckets:
            cfg = (
                None if layer.bias is not None else sg.tuned_config(rows, n, k, layer.weight.dtype)
            )
            table.append(decode_default if cfg is None else sg.linear_kernel(layer, cfg))
        return [*table, plain]

    def build_silu_kernels(self, layer: Linear, target: KernelTarget) -> list[SiluKernel | None]:
        table: list[SiluKernel | None] = [None] * (len(target.row_buckets) + 1)
        if not target.fused or layer.bias is not None:
            return table
        from vllm.model_executor.layers import skinny_gemm as sg

        n, k = layer.weight.shape
        for i, rows in enumerate(target.row_buckets):
            cfg = sg.tuned_silu_config(rows, n, k, layer.weight.dtype)
            if cfg is not None:
                table[i] = sg.silu_kernel(layer, cfg)
        return table


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with a loadable weight in the layer's storage format.

    ``shards`` (name, rows) stacks several checkpoint matrices along the output dimension.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        fmt: LinearFormat | None = None,
        shards: Sequence[tuple[str, int]] = (),
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        offsets, start = {}, 0
        for name, size in shards:
            offsets[name] = (start, size)
            start += size
        if shards and start != out_features:
            raise ValueError(f"shards {list(shards)} do not add up to {out_features} rows")
        self.shards: dict[str, tuple[int, int]] = offsets
        self.fmt = fmt or UnquantizedFormat()
        self.weight: nn.Parameter
        self.bias: nn.Parameter | None
        self.fmt.create_weights(self)
        # Torch kernels until ``select_kernels`` runs (one entry serves every bucket index).
        self._kernels: list[LinearKernel] = [self.fmt.torch_kernel(self)]
        self._silu_kernels: list[SiluKernel | None] = [None]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the layer's inputs and outputs (a quantized weight's storage differs)."""
        return self.fmt.compute_dtype(self)

    def select_kernels(self, target: KernelTarget) -> None:
        self._kernels = self.fmt.build_kernels(self, target)
        self._silu_kernels = (
            self.fmt.build_silu_kernels(self, target)
            if set(self.shards) == {"gate", "up"}
            else [None] * len(self._kernels)
        )

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; ``out`` (optional, may be float32) receives the result
        rounded to x's dtype, as ``linear(x).float()`` would."""
        kernels = self._kernels
        return kernels[row_bucket() if len(kernels) > 1 else 0](x, out)

    def silu_kernel(self) -> SiluKernel | None:
        """The step's fused gate|up + SiLU-and-multiply kernel, or None (then apply the layer
        and the activation separately)."""
        kernels = self._silu_kernels
        return kernels[row_bucket() if len(kernels) > 1 else 0]

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object) -> None:
        """Copies one checkpoint matrix into its rows of the stacked weight."""
        if shard_id not in self.shards:
            raise WeightShapeError(f"unknown shard {shard_id!r}")
        start, size = self.shards[shard_id]  # type: ignore[index]
        _check_plain(loaded)
        expected = (size, self.in_features)
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(f"expected shape {expected}, got {tuple(loaded.shape)}")
        with torch.no_grad():
            param[start : start + size].copy_(loaded)


class MergedLinear(Linear):
    """Several bias-free projections of the same input stacked into one weight.

    ``shard_names[i]`` names the checkpoint tensor that fills rows
    ``sum(sizes[:i]) : sum(sizes[:i+1])``.
    """

    def __init__(
        self,
        in_features: int,
        sizes: Sequence[int],
        shard_names: Sequence[str],
        fmt: LinearFormat | None = None,
    ) -> None:
        assert len(sizes) == len(shard_names)
        super().__init__(
            in_features,
            sum(sizes),
            bias=False,
            fmt=fmt,
            shards=list(zip(shard_names, sizes, strict=True)),
        )
        self.sizes = tuple(sizes)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)
