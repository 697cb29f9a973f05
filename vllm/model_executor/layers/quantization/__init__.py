"""Quantized weights: which storage format each linear layer gets, decided at construction.

A model is built with an optional :class:`QuantizationConfig`; each linear layer asks it for
its :class:`~vllm.model_executor.layers.linear.LinearFormat` by the layer's parameter prefix
(``language_model.model.layers.0.self_attn.qkv_proj``) and, for a fused layer, the shard ids
it stacks. Without a config every layer keeps the unquantized format (today's behaviour).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearFormat
from vllm.transformers_utils.config import QuantSpec

logger = init_logger(__name__)

SUPPORTED_METHODS = ("bitsandbytes",)
_SUPPORTED_TEXT = "bitsandbytes 4-bit (NF4 or FP4; quantization='bitsandbytes')"


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


def layer_format(
    quant: QuantizationConfig | None, prefix: str, shards: Sequence[str] = ()
) -> LinearFormat | None:
    """The format for a layer, or None (the layer's default, unquantized) without a config."""
    return None if quant is None else quant.format_for(prefix, shards)


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the top level."""
    return f"{prefix}.{name}" if prefix else name


def resolve_quantization(
    flag: str | None, load_format: str, checkpoint: QuantSpec | None
) -> str | None:
    """The quantization method an engine runs: the ``--quantization`` flag, else the one of the
    checkpoint's config.json; raises ValueError naming what is supported when the flag, the
    checkpoint or ``--load-format`` ask for something not built."""
    if flag is not None and flag.lower() not in SUPPORTED_METHODS:
        raise ValueError(
            f"quantization={flag!r} is not supported yet; this engine serves "
            f"bf16/fp16/fp32 weights and {_SUPPORTED_TEXT}"
        )
    method = flag.lower() if flag is not None else None
    if checkpoint is not None:
        if checkpoint.method not in SUPPORTED_METHODS:
            raise ValueError(
                f"the checkpoint is quantized with {checkpoint.method!r} (config.json"
                f" quantization_config.quant_method), which is not supported; "
                f"supported: {_SUPPORTED_TEXT}"
            )
        if checkpoint.load_in_8bit or not checkpoint.load_in_4bit:
            raise ValueError(
                "the checkpoint is 8-bit bitsandbytes (LLM.int8, load_in_8bit), "
                f"which is not supported; supported: {_SUPPORTED_TEXT}"
            )
        if checkpoint.quant_storage not in (None, "uint8"):
            raise ValueError(
                f"bnb_4bit_quant_storage={checkpoint.quant_storage!r} is not supported (uint8 is)"
            )
        if method is None:
            logger.info(
                "config.json: a bitsandbytes 4-bit checkpoint (quantization 'bitsandbytes')"
            )
            method = checkpoint.method
    if load_format == "bitsandbytes" and method != "bitsandbytes":
        raise ValueError(
            "load_format='bitsandbytes' needs quantization='bitsandbytes' (or a "
            "checkpoint whose config.json has quantization_config.quant_method "
            "'bitsandbytes')"
        )
    return method
