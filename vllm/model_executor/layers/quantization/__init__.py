"""Quantized weights: which storage format each linear layer gets, decided at construction.

A model is built with an optional :class:`QuantizationConfig`; each linear layer asks it for
its :class:`~vllm.model_executor.layers.linear.LinearFormat` by the layer's parameter prefix
(``language_model.model.layers.0.self_attn.qkv_proj``) and, for a fused layer, the shard ids
it stacks. Without a config every layer keeps the unquantized format.

Methods (vLLM's names): ``bitsandbytes`` (4-bit NF4/FP4, ``bitsandbytes.py``),
``compressed-tensors`` (FP8 checkpoints, ``fp8.py``) and ``fp8`` (FP8 quantized at load).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearFormat
from vllm.transformers_utils.config import QuantSpec

logger = init_logger(__name__)

SUPPORTED_METHODS = ("bitsandbytes", "compressed-tensors", "fp8")
SUPPORTED_TEXT = (
    "bitsandbytes 4-bit (NF4 or FP4; quantization='bitsandbytes'), FP8 weights from a "
    "compressed-tensors 'float-quantized' checkpoint (quantization='compressed-tensors', "
    "read from config.json), or FP8 quantized at load (quantization='fp8')"
)


class QuantizationError(ValueError):
    """A checkpoint's quantization cannot be served as it is (names the layer at fault)."""


class QuantizationConfig(ABC):
    """Chooses the storage format of every linear layer of one model."""

    name: str

    @abstractmethod
    def format_for(self, prefix: str, shards: Sequence[str] = ()) -> LinearFormat:
        """The format of the layer at ``prefix`` (``shards``: the checkpoint matrices a fused
        layer stacks, in order; empty for a plain layer)."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name


class DequantScratch:
    """One matrix buffer per (device, dtype) shared by every quantized layer of a model:
    prefill-sized inputs dequantize their weight into it, then run a library GEMM. Sized at
    load (when kernels are chosen) for the largest layer, so nothing is allocated per step."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def reserve(self, numel: int, device: torch.device, dtype: torch.dtype) -> None:
        buf = self._buffers.get((device, dtype))
        if buf is None or buf.numel() < numel:
            self._buffers[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)

    def matrix(self, n: int, k: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self._buffers[(device, dtype)][: n * k].view(n, k)


def layer_format(
    quant: QuantizationConfig | None, prefix: str, shards: Sequence[str] = ()
) -> LinearFormat | None:
    """The format for a layer, or None (the layer's default, unquantized) without a config."""
    return None if quant is None else quant.format_for(prefix, shards)


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the top level."""
    return f"{prefix}.{name}" if prefix else name


def check_quantization_flag(flag: str | None) -> None:
    """Raises ValueError naming what is supported unless ``flag`` is a method built here."""
    if flag is not None and flag.lower() not in SUPPORTED_METHODS:
        raise ValueError(
            f"quantization={flag!r} is not supported; this engine serves bf16/fp16/fp32 "
            f"weights, {SUPPORTED_TEXT}"
        )


def _check_bitsandbytes(checkpoint: QuantSpec) -> None:
    if checkpoint.load_in_8bit or not checkpoint.load_in_4bit:
        raise ValueError(
            "the checkpoint is 8-bit bitsandbytes (LLM.int8, load_in_8bit), "
            f"which is not supported; supported: {SUPPORTED_TEXT}"
        )
    if checkpoint.quant_storage not in (None, "uint8"):
        raise ValueError(
            f"bnb_4bit_quant_storage={checkpoint.quant_storage!r} is not supported (uint8 is)"
        )


def resolve_quantization(
    flag: str | None, load_format: str, checkpoint: QuantSpec | None
) -> str | None:
    """The quantization method an engine runs: the checkpoint's (config.json), or else the
    ``--quantization`` flag; raises ValueError naming what is supported when the flag, the
    checkpoint or ``--load-format`` ask for something not built, or the flag contradicts the
    checkpoint."""
    check_quantization_flag(flag)
    method = flag.lower() if flag is not None else None
    if checkpoint is not None:
        if checkpoint.method == "bitsandbytes":
            _check_bitsandbytes(checkpoint)
        elif checkpoint.method == "compressed-tensors":
            from vllm.model_executor.layers.quantization.compressed_tensors import (
                parse_compressed_tensors,
            )

            parse_compressed_tensors(checkpoint.config)  # raises for schemes not served
        else:
            raise ValueError(
                f"the checkpoint is quantized with {checkpoint.method!r} (config.json"
                f" quantization_config.quant_method), which is not supported; "
                f"supported: {SUPPORTED_TEXT}"
            )
        if method is not None and method != checkpoint.method:
            raise ValueError(
                f"quantization={method!r} does not match the checkpoint's quantization method "
                f"{checkpoint.method!r} (config.json quantization_config.quant_method); leave "
                f"--quantization out or pass {checkpoint.method!r}"
            )
        if method is None:
            logger.info("config.json: a %s checkpoint", checkpoint.method)
        method = checkpoint.method
    elif method == "compressed-tensors":
        raise ValueError(
            "quantization='compressed-tensors' needs a checkpoint whose config.json has a "
            "compressed-tensors quantization_config; to quantize a bf16 checkpoint to FP8 at "
            "load, pass quantization='fp8'"
        )
    if load_format == "bitsandbytes" and method != "bitsandbytes":
        raise ValueError(
            "load_format='bitsandbytes' needs quantization='bitsandbytes' (or a "
            "checkpoint whose config.json has quantization_config.quant_method "
            "'bitsandbytes')"
        )
    return method
