"""FP8 weights: e4m3 matrices with per-output-channel scales, served weight-only.

A layer stores ``weight`` as float8_e4m3fn [N, K] and ``weight_scale`` as float32 [N] (a
per-tensor checkpoint scale repeated over its rows; bf16 scales are exact in float32), plus
the dtype the checkpoint's scales had (``fp8_scale_dtype``). A fused layer (q|k|v, gate|up,
cross k|v) is one matrix: its shards' rows and scales stacked.

Numerics are weight-only, as transformers runs a decompressed compressed-tensors checkpoint
(``CompressedTensorsConfig(dequantize=True)``, the test reference): the weight is
``(fp8 -> scale dtype) * scale`` in the scale's dtype, then cast to the activation dtype;
activations are never quantized.

Kernel tables: with the fused kernels, the decode row buckets run the Triton GEMM that
converts the FP8 tile in registers and applies the channel scale in its epilogue
(``fp8_gemm.py``; gate|up also with the SiLU-and-multiply epilogue); any other row count
(prefill) dequantizes into a scratch matrix shared by all quantized layers of the model and
runs ``F.linear`` on it. Without them (the CPU torch path) every entry dequantizes with torch.

Quantization at load (``--quantization fp8`` on a bf16 checkpoint, and dummy weights) follows
compressed-tensors' FP8_DYNAMIC weights bitwise: per row, scale = max(|min(w, 0)|, max(w, 0))
/ 448 in the model dtype (zero scales replaced by that dtype's eps), and
fp8 = clamp(w / scale, -448, 448) rounded to e4m3. It runs on the device a few rows at a time,
so loading holds the FP8 model plus a bounded slice of one bf16 tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import get_tp
from vllm.distributed.tensor_parallel import rank_columns
from vllm.model_executor.layers.kernel_target import KernelTarget
from vllm.model_executor.layers.linear import (
    FP8_DTYPES,
    Linear,
    LinearFormat,
    LinearKernel,
    SiluKernel,
    UnquantizedFormat,
    WeightShapeError,
)
from vllm.model_executor.layers.quantization import (
    DequantScratch,
    QuantizationConfig,
    QuantizationError,
)
from vllm.model_executor.layers.quantization.compressed_tensors import (
    CompressedTensorsScheme,
    matches,
)
from vllm.model_executor.models.mllama_weights import checkpoint_modules

if TYPE_CHECKING:  # Triton is imported only where the fused kernels are chosen
    from vllm.model_executor.layers.fp8_gemm import Fp8Weight

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements quantized per step at load: bounds the transient device memory of one tensor.
_CHUNK_ELEMENTS = 1 << 24
# The layers the published FP8 checkpoints keep in bf16 (RedHatAI's recipe: lm_head, the
# projector, the vision tower), which quantization at load keeps too.
PUBLISHED_IGNORE = ("re:.*lm_head", "re:multi_modal_projector.*", "re:vision_model.*")


@torch.no_grad()
def quantize_fp8(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] in the model dtype -> (float8_e4m3fn [N, K], scales [N, 1] or [1] in
    ``w``'s dtype), compressed-tensors' symmetric minmax FP8 quantization, bitwise."""
    if per_tensor:
        lo, hi = w.amin().reshape(1, 1), w.amax().reshape(1, 1)
    else:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    amax = torch.maximum(lo.clamp(max=0).abs(), hi.clamp(min=0).abs())
    scale = amax / torch.tensor(FP8_MAX, dtype=w.dtype)
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)  # as compressed-tensors
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(1) if per_tensor else scale


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, scale_dtype: torch.dtype, dtype: torch.dtype
) -> torch.Tensor:
    """The reference's dense weight: ``(weight -> scale_dtype) * scale`` in the scale dtype,
    then cast to ``dtype`` (``scale``: float32 [N], holding values of ``scale_dtype``)."""
    return (weight.to(scale_dtype) * scale.to(scale_dtype)[:, None]).to(dtype)


class Fp8Format(LinearFormat):
    """A linear layer's weight in FP8 with channel scales (see the module docstring).

    ``per_tensor``: the checkpoint has one scale per matrix (repeated over its rows).
    ``quantize_on_load``: plain checkpoint tensors are quantized as they load (the scales are
    then buffers the checkpoint does not provide); otherwise the loader accepts only FP8
    matrices and their ``weight_scale`` tensors."""

    name = "fp8"

    def __init__(
        self,
        per_tensor: bool = False,
        scratch: DequantScratch | None = None,
        quantize_on_load: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.per_tensor = per_tensor
        self.scratch = scratch or DequantScratch()
        self.quantize_on_load = quantize_on_load
        self._dtype = dtype

    # ------------------------------------------------------------------ storage
    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        dtype = self._dtype or torch.get_default_dtype()
        layer.fp8_dtype = dtype  # type: ignore[attr-defined]
        # Quantized here: scales in the model dtype; from a checkpoint: its scales' dtype.
        layer.fp8_scale_dtype = dtype if self.quantize_on_load else None  # type: ignore[attr-defined]
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
        loader = functools.partial(self._load_weight, layer)
        # Quantized here, a row-parallel matrix comes whole (its rows' scales are those of one
        # rank); this rank's columns are kept after (``tensor_parallel.takes_whole``).
        loader.quantizes_whole_rows = self.quantize_on_load  # type: ignore[attr-defined]
        layer.weight.weight_loader = loader  # type: ignore[attr-defined]
        scale = torch.empty(n, dtype=torch.float32)
        if self.quantize_on_load:
            layer.register_buffer("weight_scale", scale)
        else:
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            layer.weight_scale.weight_loader = functools.partial(self._load_scale, layer)  # type: ignore[attr-defined]
        layer.bias = (
            nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False)
            if layer.has_bias
            else None
        )

    def compute_dtype(self, layer: Linear) -> torch.dtype:
        return layer.fp8_dtype  # type: ignore[attr-defined, no-any-return]

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _rows(layer: Linear, shard_id: object) -> tuple[int, int]:
        if not layer.shards:
            if shard_id is not None:
                raise WeightShapeError(f"unknown shard {shard_id!r}")
            return 0, layer.out_features
        if shard_id not in layer.shards:
            raise WeightShapeError(f"unknown shard {shard_id!r}")
        return layer.shards[shard_id]  # type: ignore[index]

    def _load_weight(
        self, layer: Linear, param: torch.Tensor, loaded: object, shard_id: object
    ) -> None:
        """Copies one checkpoint matrix (FP8, or a plain tensor to quantize) into its rows."""
        start, rows = self._rows(layer, shard_id)
        if not isinstance(loaded, torch.Tensor):
            raise WeightShapeError(f"cannot load a {type(loaded).__name__}")
        width = layer.in_features
        if self.quantize_on_load and loaded.dim() == 2 and loaded.shape[1] != width:
            width *= get_tp().size  # a row-parallel matrix given whole (``takes_whole``)
        if tuple(loaded.shape) != (rows, width):
            raise WeightShapeError(f"expected shape {(rows, width)}, got {tuple(loaded.shape)}")
        if self.quantize_on_load:
            if loaded.dtype in FP8_DTYPES or not loaded.is_floating_point():
                raise WeightShapeError(f"expected a bf16/fp16/fp32 matrix, got {loaded.dtype}")
            self._quantize_rows(layer, param, loaded, start)
            return
        if loaded.dtype != FP8_DTYPE:
            raise WeightShapeError(
                f"expected a float8_e4m3fn matrix (the checkpoint's quantization_config "
                f"quantizes this layer), got {loaded.dtype}"
            )
        with torch.no_grad():
            param[start : start + rows].copy_(loaded)

    def _quantize_rows(
        self, layer: Linear, param: torch.Tensor, loaded: torch.Tensor, start: int
    ) -> None:
        """Quantizes ``loaded`` on the layer's device, a bounded number of rows at a time."""
        step = max(1, _CHUNK_ELEMENTS // max(1, loaded.shape[1]))
        with torch.no_grad():
            for r in range(0, loaded.shape[0], step):
                w = loaded[r : r + step].to(device=param.device, dtype=self.compute_dtype(layer))
                q, s = quantize_fp8(w)
                if w.shape[1] != layer.in_features:  # the whole row's scale, this rank's part
                    q = rank_columns(q, layer.in_features, get_tp())
                param[start + r : start + r + w.shape[0]].copy_(q)
                layer.weight_scale[start + r : start + r + w.shape[0]].copy_(s.view(-1))

    def _load_scale(
        self, layer: Linear, param: torch.Tensor, loaded: object, shard_id: object
    ) -> None:
        """Copies one checkpoint matrix's ``weight_scale`` ([rows, 1], or one value per
        tensor) into its rows, in float32; every shard must have the same scale dtype."""
        start, rows = self._rows(layer, shard_id)
        if not isinstance(loaded, torch.Tensor) or loaded.dtype not in _DTYPES:
            got = loaded.dtype if isinstance(loaded, torch.Tensor) else type(loaded).__name__
            raise WeightShapeError(f"expected bf16/fp16/fp32 scales, got {got}")
        expected = "one value" if self.per_tensor else f"[{rows}, 1]"
        ok = loaded.numel() == 1 if self.per_tensor else tuple(loaded.shape) in ((rows, 1), (rows,))
        if not ok:
            raise WeightShapeError(
                f"expected {expected} weight scales (strategy "
                f"{'tensor' if self.per_tensor else 'channel'}), got shape {tuple(loaded.shape)}"
            )
        previous = layer.fp8_scale_dtype  # type: ignore[attr-defined]
        if previous is not None and previous != loaded.dtype:
            raise WeightShapeError(
                f"the shards of this fused layer have {previous} and {loaded.dtype} scales"
            )
        layer.fp8_scale_dtype = loaded.dtype  # type: ignore[attr-defined]
        with torch.no_grad():
            param[start : start + rows].copy_(loaded.reshape(-1).float().expand(rows))

    # ------------------------------------------------------------------ math
    def scale_dtype(self, layer: Linear) -> torch.dtype:
        dt = layer.fp8_scale_dtype  # type: ignore[attr-defined]
        assert dt is not None, "FP8 layer used before its scales were loaded"
        return dt  # type: ignore[no-any-return]

    def dequantize(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in ``dtype`` (torch; the reference the kernels are held to)."""
        return dequantize(layer.weight, layer.weight_scale, self.scale_dtype(layer), dtype)

    def fp8_weight(self, layer: Linear, max_rows: int = 0) -> Fp8Weight:
        """The layer's tensors as the Triton kernels take them; with ``max_rows``, K-split
        counters for decode inputs of up to that many rows."""
        from vllm.model_executor.layers.fp8_gemm import Fp8Weight, make_counters

        counters = None
        if max_rows:
            counters = make_counters(layer.out_features, max_rows, layer.weight.device)
        return Fp8Weight(layer.weight, layer.weight_scale, self.scale_dtype(layer), counters)

    # ------------------------------------------------------------------ kernels
    def torch_kernel(self, layer: Linear) -> LinearKernel:
        def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            y = F.linear(x, self.dequantize(layer, x.dtype), layer.bias)
            return y if out is None else out.copy_(y)

        return run

    def _scratch_kernel(self, layer: Linear, fw: Fp8Weight) -> LinearKernel:
        from vllm.model_executor.layers import fp8_gemm

        n, k = layer.out_features, layer.in_features
        dtype, device = self.compute_dtype(layer), layer.weight.device
        self.scratch.reserve(n * k, device, dtype)

        def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            w = fp8_gemm.dequantize(fw, self.scratch.matrix(n, k, device, dtype))
            y = F.linear(x, w, layer.bias)
            return y if out is None else out.copy_(y)

        return run

    def _fused_gemm(self, layer: Linear, target: KernelTarget) -> bool:
        """The FP8 GEMM serves the decode buckets of bias-free layers (the text decoder's;
        biased layers only see prefill-sized inputs)."""
        return (
            target.fused
            and layer.bias is None
            and self.compute_dtype(layer) in _DTYPES
            and layer.in_features % 16 == 0
        )

    def build_kernels(self, layer: Linear, target: KernelTarget) -> list[LinearKernel]:
        count = len(target.row_buckets) + 1
        if not target.fused:
            return [self.torch_kernel(layer)] * count
        from vllm.model_executor.layers import fp8_gemm

        fused = self._fused_gemm(layer, target)
        fw = self.fp8_weight(layer, max(target.row_buckets, default=0) if fused else 0)
        any_rows = self._scratch_kernel(layer, fw)
        if not fused:
            return [any_rows] * count
        n, k, gpu = layer.out_features, layer.in_features, _device_name(target)
        decode = []
        for rows in target.row_buckets:
            cfg = fp8_gemm.decode_config(rows, n, k, device_name=gpu)
            decode.append(any_rows if cfg is None else fp8_gemm.linear_kernel(fw, cfg))
        return [*decode, any_rows]

    def build_silu_kernels(self, layer: Linear, target: KernelTarget) -> list[SiluKernel | None]:
        table: list[SiluKernel | None] = [None] * (len(target.row_buckets) + 1)
        if not self._fused_gemm(layer, target):
            return table
        from vllm.model_executor.layers import fp8_gemm

        fw = self.fp8_weight(layer, max(target.row_buckets, default=0))
        n, k, gpu = layer.out_features // 2, layer.in_features, _device_name(target)
        for i, rows in enumerate(target.row_buckets):
            cfg = fp8_gemm.decode_config(rows, n, k, silu=True, device_name=gpu)
            table[i] = None if cfg is None else fp8_gemm.silu_kernel(fw, cfg)
        return table


def _device_name(target: KernelTarget) -> str:
    """The GPU model whose tuned GEMM configs apply ("" off CUDA: the default configs)."""
    if target.device.type != "cuda":
        return ""
    return torch.cuda.get_device_name(target.device)


class Fp8Config(QuantizationConfig):
    """Which layers are FP8.

    From a compressed-tensors checkpoint (``scheme``): a layer is FP8 when its checkpoint
    modules are targeted and not ignored, all shards of a fused layer alike. Otherwise
    (quantization at load, dummy weights) every linear layer the published checkpoints
    quantize: all but the vision tower, the projector and the LM head."""

    def __init__(self, scheme: CompressedTensorsScheme | None = None) -> None:
        self.scheme = scheme
        self.name = "fp8" if scheme is None else "compressed-tensors"
        self.scratch = DequantScratch()
        self.quantized: dict[str, str] = {}  # layer prefix -> scale strategy

    @property
    def prequantized(self) -> bool:
        return self.scheme is not None

    def _strategy(self, names: tuple[str, str]) -> str | None:
        if self.scheme is None:
            return None if any(matches(e, names) for e in PUBLISHED_IGNORE) else "channel"
        return self.scheme.strategy_for(names)

    def format_for(self, prefix: str, shards: Sequence[str] = ()) -> LinearFormat:
        wanted: list[str | None] = list(shards) or [None]
        strategies = {s: self._strategy(checkpoint_modules(prefix, s)) for s in wanted}
        kinds = set(strategies.values())
        if len(kinds) > 1:
            fp8 = [s for s, k in strategies.items() if k is not None]
            plain = [s for s, k in strategies.items() if k is None]
            if fp8 and plain:
                raise QuantizationError(
                    f"{prefix}: the checkpoint's quantization_config quantizes only part of "
                    f"this fused layer (shards {fp8} are FP8, {plain} are ignored); the "
                    f"matrices of a fused projection ({', '.join(map(str, wanted))}) must be "
                    "quantized alike"
                )
            raise QuantizationError(
                f"{prefix}: the shards of this fused layer have different FP8 scale "
                f"strategies ({strategies})"
            )
        strategy = kinds.pop()
        if strategy is None:
            return UnquantizedFormat()
        self.quantized[prefix] = strategy
        return Fp8Format(
            per_tensor=strategy == "tensor",
            scratch=self.scratch,
            quantize_on_load=self.scheme is None,
        )

    def describe(self) -> str:
        kinds = sorted({f"per-{s} scales" for s in self.quantized.values()})
        source = "compressed-tensors checkpoint" if self.prequantized else "quantized at load"
        return (
            f"FP8 e4m3 weights ({'; '.join(kinds) or 'none'}; weight-only) on "
            f"{len(self.quantized)} linear layers, {source}"
        )
