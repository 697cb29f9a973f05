"""bitsandbytes 4-bit (NF4 / FP4) linear layers: storage, checkpoint loading, kernel tables.

A layer stores its weight as the checkpoint does: ``weight`` holds the packed 4-bit indices as
uint8 [N, K / 2] (row n's bytes are the checkpoint's bytes n * K / 2 onwards), ``absmax`` one
scale per block of a row [N, K / blocksize] (uint8 indices with double quantization, float32
without), and with double quantization ``nested_absmax`` (the shards' second-level scales
concatenated), ``nested_code`` (the 8-bit table) and per shard its offset and where its rows and
second-level scales start. A fused layer (q|k|v, gate|up, cross k|v) is one such matrix: its
checkpoint matrices' packed rows stacked, their scales concatenated. Nothing is expanded at
load, so a decode step reads the checkpoint's bytes.

Kernel tables: with the fused kernels, the small decode row buckets run the Triton GEMM that
dequantizes in registers (``nf4_gemm.py``; gate|up also with the SiLU-and-multiply epilogue)
where the tuned table (or the heuristic) gives them to it; every other row count (larger
buckets, prefill, the vision tower) dequantizes the weight into a scratch matrix shared by all
layers of the model and runs ``F.linear`` on it. Without them (the CPU torch
path) every entry dequantizes with torch (``bnb_codec``) and runs ``F.linear``.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import get_tp
from vllm.model_executor.layers.kernel_target import KernelTarget
from vllm.model_executor.layers.linear import (
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
from vllm.model_executor.layers.quantization.bnb_codec import (
    NESTED_BLOCKSIZE,
    Packed4bit,
    QuantState4bit,
    code_table,
    dequantize_codes,
    device_code,
    nested_scales,
    quantize_4bit,
    slice_4bit,
)

if TYPE_CHECKING:  # Triton is imported only where the fused kernels are chosen
    from vllm.model_executor.layers.nf4_gemm import QuantizedWeight

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Bnb4bitSpec:
    """How a layer's blocks are stored."""

    quant_type: str = "nf4"
    blocksize: int = 64
    nested: bool = True

    def __str__(self) -> str:
        nested = "double quantization" if self.nested else "float32 block scales"
        return f"{self.quant_type}, blocksize {self.blocksize}, {nested}"


@dataclass(frozen=True)
class _Shard:
    """Where one checkpoint matrix lives in its layer."""

    row: int
    rows: int
    group: int  # first second-level scale
    groups: int


class Bnb4bitFormat(LinearFormat):
    """A linear layer's weight in bitsandbytes' 4-bit format (see the module docstring).

    ``quantize_on_load``: plain checkpoint tensors are quantized as they load (NF4 of a bf16
    checkpoint); otherwise the loader accepts only :class:`Packed4bit` matrices.

    With several tensor-parallel ranks the layer holds its slice with float32 block scales
    (``bnb_codec.slice_4bit``: a slice cuts the 256-block groups of double quantization),
    and a matrix quantized at load comes whole, is quantized as with one rank (``spec``) and
    sliced; ``layout`` is what the layer stores."""

    name = "bitsandbytes"

    def __init__(
        self,
        spec: Bnb4bitSpec,
        scratch: DequantScratch | None = None,
        quantize_on_load: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.spec = spec  # how the checkpoint's matrices are (or are to be) quantized
        self.tp = get_tp()
        self.layout = spec if self.tp.size == 1 else replace(spec, nested=False)
        self.scratch = scratch or DequantScratch()
        self.quantize_on_load = quantize_on_load
        self._dtype = dtype

    # ------------------------------------------------------------------ storage
    def create_weights(self, layer: Linear) -> None:
        n, k, bs = layer.out_features, layer.in_features, self.spec.blocksize
        if k % bs:
            ranks = (
                f" (one of {self.tp.size} tensor-parallel ranks' part)" if self.tp.size > 1 else ""
            )
            raise QuantizationError(
                f"input width {k}{ranks} is not a multiple of the blocksize {bs}"
            )
        layer.bnb_dtype = self._dtype or torch.get_default_dtype()  # type: ignore[attr-defined]
        layer.bnb_shards = self._shards(layer)  # type: ignore[attr-defined]
        layer.weight = nn.Parameter(torch.empty(n, k // 2, dtype=torch.uint8), requires_grad=False)
        loader = functools.partial(self._load, layer)
        loader.quantizes_whole_matrix = self.quantize_on_load  # type: ignore[attr-defined]
        layer.weight.weight_loader = loader  # type: ignore[attr-defined]
        scale_dtype = torch.uint8 if self.layout.nested else torch.float32
        layer.register_buffer("absmax", torch.empty(n, k // bs, dtype=scale_dtype))
        layer.register_buffer("quant_code", code_table(self.spec.quant_type))
        if self.layout.nested:
            shards = layer.bnb_shards  # type: ignore[attr-defined]
            groups = sum(s.groups for s in shards)
            index = [[s.row, s.group] for s in shards]
            layer.register_buffer("nested_absmax", torch.empty(groups, dtype=torch.float32))
            layer.register_buffer("nested_code", torch.zeros(256, dtype=torch.float32))
            layer.register_buffer("shard_index", torch.tensor(index, dtype=torch.int32))
            layer.register_buffer("shard_offsets", torch.zeros(len(shards), dtype=torch.float32))
        layer.bias = (
            nn.Parameter(torch.empty(n, dtype=layer.bnb_dtype), requires_grad=False)  # type: ignore[attr-defined]
            if layer.has_bias
            else None
        )

    def _shards(self, layer: Linear) -> list[_Shard]:
        spans = list(layer.shards.values()) or [(0, layer.out_features)]
        out, group = [], 0
        for row, rows in spans:
            blocks = rows * layer.in_features // self.spec.blocksize
            groups = -(-blocks // NESTED_BLOCKSIZE) if self.layout.nested else 0
            out.append(_Shard(row, rows, group, groups))
            group += groups
        return out

    def compute_dtype(self, layer: Linear) -> torch.dtype:
        return layer.bnb_dtype  # type: ignore[attr-defined, no-any-return]

    # ------------------------------------------------------------------ loading
    def _load(self, layer: Linear, param: torch.Tensor, loaded: object, shard_id: object) -> None:
        """Copies one checkpoint matrix (a :class:`Packed4bit`, or a plain tensor to quantize)
        into its rows of the layer."""
        names = list(layer.shards) or [None]
        if shard_id not in names:
            raise WeightShapeError(f"unknown shard {shard_id!r}")
        i = names.index(shard_id)
        shard = layer.bnb_shards[i]  # type: ignore[attr-defined]
        k, bs = layer.in_features, self.spec.blocksize
        packed = self._as_packed(layer, param, loaded, shard.rows)
        with torch.no_grad():
            param[shard.row : shard.row + shard.rows].copy_(packed.packed.reshape(shard.rows, -1))
            rows = layer.absmax[shard.row : shard.row + shard.rows]
            rows.copy_(packed.absmax.reshape(shard.rows, k // bs))
            if self.layout.nested:
                assert packed.nested_absmax is not None and packed.nested_code is not None
                assert packed.nested_offset is not None
                layer.nested_absmax[shard.group : shard.group + shard.groups].copy_(
                    packed.nested_absmax.reshape(-1)
                )
                layer.shard_offsets[i].copy_(packed.nested_offset)
                self._load_nested_code(layer, packed.nested_code)

    def _as_packed(
        self, layer: Linear, param: torch.Tensor, loaded: object, rows: int
    ) -> Packed4bit:
        """The checkpoint matrix as a :class:`Packed4bit` of this layer's layout, checked."""
        k, spec = layer.in_features, self.spec
        if isinstance(loaded, torch.Tensor):
            if not self.quantize_on_load:
                raise WeightShapeError("expected a bitsandbytes 4-bit matrix, got a plain tensor")
            n = self.tp.size
            # With several ranks a split matrix comes whole (``takes_whole``): its rows or its
            # columns are n times this rank's.
            shape = tuple(loaded.shape)
            if shape == (rows, k):
                dim = None
            elif n > 1 and shape in ((rows * n, k), (rows, k * n)):
                dim = 0 if shape == (rows * n, k) else 1
            else:
                raise WeightShapeError(f"expected shape {(rows, k)}, got {shape}")
            # Cast to the model dtype first: the weights a bf16 model would hold, quantized.
            w = loaded.to(device=param.device, dtype=self.compute_dtype(layer))
            packed = quantize_4bit(w, spec.quant_type, spec.blocksize, spec.nested)
            if n > 1 and dim is not None:
                part = (rows, k)[dim]
                packed = slice_4bit(packed, dim, self.tp.rank * part, part)
            elif n > 1:  # a whole parameter (the vision tower's), its scales as the layout's
                packed = slice_4bit(packed, 0, 0, rows)
            return packed
        if not isinstance(loaded, Packed4bit):
            raise WeightShapeError(f"cannot load a {type(loaded).__name__}")
        self._check_packed(loaded, rows, k)
        return loaded

    def _check_packed(self, p: Packed4bit, rows: int, k: int) -> None:
        """Raises WeightShapeError unless ``p`` is a [rows, k] matrix in this layer's format."""
        st, spec = p.state, self.layout
        got = Bnb4bitSpec(st.quant_type, st.blocksize, st.nested)
        if st.shape != (rows, k) or got != spec:
            raise WeightShapeError(
                f"quantized as {list(st.shape)} ({got}); the layer holds {[rows, k]} ({spec})"
            )
        scale_dtype = torch.uint8 if spec.nested else torch.float32
        sizes = (p.packed.numel() * 2, p.absmax.numel(), p.absmax.dtype)
        if sizes != (rows * k, st.num_blocks, scale_dtype):
            raise WeightShapeError(
                f"{p.packed.numel()} packed bytes and {p.absmax.numel()} {p.absmax.dtype} block "
                f"scales do not hold {[rows, k]} in blocks of {spec.blocksize}"
            )
        if spec.nested and (p.nested_absmax is None or p.nested_absmax.numel() != st.num_groups):
            found = None if p.nested_absmax is None else p.nested_absmax.numel()
            raise WeightShapeError(f"nested_absmax has {found} scales, expected {st.num_groups}")

    @staticmethod
    def _load_nested_code(layer: Linear, code: torch.Tensor) -> None:
        """The layer keeps one 8-bit table; every shard must bring the same one."""
        if getattr(layer, "bnb_code_loaded", False):
            if not torch.equal(layer.nested_code, code.to(layer.nested_code.device)):
                raise WeightShapeError(
                    "the shards of this fused layer have different nested_quant_map tables"
                )
            return
        layer.nested_code.copy_(code.reshape(-1))
        layer.bnb_code_loaded = True  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ math
    def block_scales(self, layer: Linear) -> torch.Tensor:
        """float32 scales [N, K / blocksize] (decoded from the 8-bit indices when nested)."""
        if not self.layout.nested:
            return layer.absmax
        parts = [
            nested_scales(
                layer.absmax[s.row : s.row + s.rows],
                layer.nested_absmax,
                layer.nested_code,
                layer.shard_offsets[i],
                s.group,
            )
            for i, s in enumerate(layer.bnb_shards)  # type: ignore[attr-defined]
        ]
        return torch.cat(parts).view(layer.out_features, -1)

    def dequantize(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in ``dtype`` (torch; the reference the kernels are held to)."""
        shape = (layer.out_features, layer.in_features)
        return dequantize_codes(
            layer.weight,
            self.block_scales(layer),
            device_code(layer.quant_code, self.spec.quant_type),
            self.spec.blocksize,
            shape,
            dtype,
        )

    def quantized_weight(self, layer: Linear) -> QuantizedWeight:
        """The layer's tensors as the Triton kernels take them."""
        from vllm.model_executor.layers.nf4_gemm import QuantizedWeight

        nested = {}
        if self.layout.nested:
            nested = dict(
                nested_absmax=layer.nested_absmax,
                nested_code=layer.nested_code,
                shard_index=layer.shard_index,
                shard_offsets=layer.shard_offsets,
            )
        return QuantizedWeight(
            layer.weight,
            layer.absmax,
            device_code(layer.quant_code, self.spec.quant_type),
            self.spec.blocksize,
            **nested,
        )

    # ------------------------------------------------------------------ kernels
    def torch_kernel(self, layer: Linear) -> LinearKernel:
        def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            y = F.linear(x, self.dequantize(layer, x.dtype), layer.bias)
            return y if out is None else out.copy_(y)

        return run

    def _scratch_kernel(self, layer: Linear, qw: QuantizedWeight) -> LinearKernel:
        from vllm.model_executor.layers import nf4_gemm

        n, k = layer.out_features, layer.in_features
        dtype, device = self.compute_dtype(layer), layer.weight.device
        self.scratch.reserve(n * k, device, dtype)

        def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            w = nf4_gemm.dequantize(qw, self.scratch.matrix(n, k, device, dtype))
            y = F.linear(x, w, layer.bias)
            return y if out is None else out.copy_(y)

        return run

    def _fused_gemm(self, layer: Linear, target: KernelTarget) -> bool:
        """The 4-bit GEMM serves the decode buckets of bias-free layers (the text decoder's;
        biased layers only see prefill-sized inputs)."""
        return target.fused and layer.bias is None and self.compute_dtype(layer) in _DTYPES

    def build_kernels(self, layer: Linear, target: KernelTarget) -> list[LinearKernel]:
        count = len(target.row_buckets) + 1
        if not target.fused:
            return [self.torch_kernel(layer)] * count
        from vllm.model_executor.layers import nf4_gemm

        qw = self.quantized_weight(layer)
        scratch = self._scratch_kernel(layer, qw)
        if not self._fused_gemm(layer, target):
            return [scratch] * count
        n, k, gpu = layer.out_features, layer.in_features, _device_name(target)
        dt = self.compute_dtype(layer)
        decode = []
        for rows in target.row_buckets:
            cfg = nf4_gemm.decode_config(rows, n, k, qw.blocksize, device_name=gpu, dtype=dt)
            decode.append(scratch if cfg is None else nf4_gemm.linear_kernel(qw, cfg))
        steps = nf4_gemm.prefill_configs(n, k, qw.blocksize, device_name=gpu, dtype=dt)
        return [*decode, self._any_rows_kernel(layer, qw, steps, scratch)]

    @staticmethod
    def _any_rows_kernel(
        layer: Linear, qw: QuantizedWeight, steps: list, scratch: LinearKernel
    ) -> LinearKernel:
        """Row counts outside the decode buckets (prefill chunks): the GEMM up to the row
        counts this GPU's tuned table gives it (``nf4_gemm.prefill_configs``), the scratch
        path above them and for inputs that are not [M, K] rows."""
        from vllm.model_executor.layers import nf4_gemm

        if all(cfg is None for _, cfg in steps):
            return scratch
        limits = [rows for rows, _ in steps]
        kernels = [scratch if cfg is None else nf4_gemm.linear_kernel(qw, cfg) for _, cfg in steps]

        def run(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
            i = bisect.bisect_left(limits, x.shape[0])
            if x.dim() != 2 or x.stride(1) != 1 or i == len(limits):
                return scratch(x, out)
            return kernels[i](x, out)

        return run

    def build_silu_kernels(self, layer: Linear, target: KernelTarget) -> list[SiluKernel | None]:
        table: list[SiluKernel | None] = [None] * (len(target.row_buckets) + 1)
        if not self._fused_gemm(layer, target):
            return table
        from vllm.model_executor.layers import nf4_gemm

        qw = self.quantized_weight(layer)
        n, k, gpu = layer.out_features // 2, layer.in_features, _device_name(target)
        dt = self.compute_dtype(layer)
        for i, rows in enumerate(target.row_buckets):
            cfg = nf4_gemm.decode_config(
                rows, n, k, qw.blocksize, silu=True, device_name=gpu, dtype=dt
            )
            table[i] = None if cfg is None else nf4_gemm.silu_kernel(qw, cfg)
        steps = nf4_gemm.prefill_configs(n, k, qw.blocksize, silu=True, device_name=gpu, dtype=dt)
        if any(cfg is not None for _, cfg in steps):
            table[-1] = self._any_rows_silu(qw, steps, self._scratch_kernel(layer, qw))
        return table

    @staticmethod
    def _any_rows_silu(qw: QuantizedWeight, steps: list, scratch: LinearKernel) -> SiluKernel:
        """gate|up with the SiLU-and-multiply for row counts outside the decode buckets: the
        GEMM's epilogue where the tuned table gives the GEMM those rows, else the scratch
        path and the separate activation (as the layer and ``SiluAndMul`` compute it)."""
        from vllm.model_executor.layers import nf4_gemm
        from vllm.model_executor.layers.fused_kernels import silu_and_mul

        limits = [rows for rows, _ in steps]
        configs = [cfg for _, cfg in steps]

        def run(x: torch.Tensor) -> torch.Tensor:
            i = bisect.bisect_left(limits, x.shape[0])
            cfg = configs[i] if i < len(limits) else None
            if cfg is None or x.dim() != 2 or x.stride(1) != 1:
                return silu_and_mul(scratch(x, None))
            return nf4_gemm.nf4_gemm_silu(x, qw, cfg)

        return run


def _device_name(target: KernelTarget) -> str:
    """The GPU model whose tuned GEMM configs apply ("" off CUDA: the heuristic)."""
    if target.device.type != "cuda":
        return ""
    return torch.cuda.get_device_name(target.device)


class BitsAndBytesConfig(QuantizationConfig):
    """Which layers are 4-bit and how.

    Pre-quantized checkpoint (``checkpoint``: layer prefix -> shard id -> its quant state): a
    layer is 4-bit exactly when the checkpoint holds quant states for it, all its shards alike.
    Otherwise (quantization at load, dummy weights) every linear layer but ``keep`` is
    ``default``, quantized as its tensors load."""

    name = "bitsandbytes"

    def __init__(
        self,
        checkpoint: Mapping[str, Mapping[str | None, QuantState4bit]] | None = None,
        default: Bnb4bitSpec = Bnb4bitSpec(),
        keep: Sequence[str] = ("language_model.lm_head",),
    ) -> None:
        self.checkpoint = checkpoint
        self.default = default
        self.keep = frozenset(keep)
        self.scratch = DequantScratch()
        self.quantized: dict[str, Bnb4bitSpec] = {}  # the layers given a 4-bit format

    @property
    def prequantized(self) -> bool:
        return self.checkpoint is not None

    def format_for(self, prefix: str, shards: Sequence[str] = ()) -> LinearFormat:
        if self.checkpoint is None:
            if prefix in self.keep:
                return UnquantizedFormat()
            self.quantized[prefix] = self.default
            return Bnb4bitFormat(self.default, self.scratch, quantize_on_load=True)
        entries = self.checkpoint.get(prefix, {})
        if not entries:
            return UnquantizedFormat()
        wanted: list[str | None] = list(shards) or [None]
        missing = [s for s in wanted if s not in entries]
        if missing:
            raise QuantizationError(
                f"{prefix}: the checkpoint quantizes only part of this fused layer (shards "
                f"{[s for s in wanted if s in entries]} are bitsandbytes 4-bit, {missing} are "
                f"not); the matrices of a fused projection ({', '.join(map(str, wanted))}) "
                "must be quantized alike"
            )
        specs = {Bnb4bitSpec(st.quant_type, st.blocksize, st.nested) for st in entries.values()}
        if len(specs) != 1:
            raise QuantizationError(
                f"{prefix}: the shards of this fused layer are quantized "
                f"differently ({'; '.join(map(str, specs))})"
            )
        spec = specs.pop()
        self.quantized[prefix] = spec
        return Bnb4bitFormat(spec, self.scratch)

    def unclaimed(self) -> list[str]:
        """Quantized checkpoint layers no linear layer took (not linear in this model)."""
        return sorted(set(self.checkpoint or {}) - set(self.quantized))

    def describe(self) -> str:
        kinds = sorted({str(s) for s in self.quantized.values()})
        source = "pre-quantized checkpoint" if self.prequantized else "quantized at load"
        return (
            f"bitsandbytes 4-bit ({'; '.join(kinds) or 'none'}) on "
            f"{len(self.quantized)} linear layers, {source}"
        )
