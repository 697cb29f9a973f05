"""Quantized weights: which storage format each linear layer gets, decided at construction.

A model is built with an optional :class:`QuantizationConfig`; each linear layer asks it for
its :class:`~vllm.model_executor.layers.linear.LinearFormat` by the layer's parameter prefix
(``language_model.model.layers.0.self_attn.qkv_proj``) and, for a fused layer, the shard ids
it stacks. Without a config every layer keeps the unquantized format (today's behaviour).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from vllm.model_executor.layers.linear import LinearFormat


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
