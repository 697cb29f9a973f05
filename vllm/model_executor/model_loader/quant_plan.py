"""How one load quantizes: the config the model is built with, what happens to the tensor stream,
and what quantized layers hold (dummy weights, memory).

A method's loader (``bitsandbytes_loader.py``, ``fp8_loader.py``) reads what it needs from the
checkpoint before the model is built and returns a :class:`QuantPlan`; ``loader.get_model``
builds the model with ``plan.config``, streams the tensors through ``plan.weights`` and calls
``plan.check_built`` once the layers exist.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.linear import Linear, UnquantizedFormat
from vllm.model_executor.layers.quantization import QuantizationConfig

# (checkpoint name, tensor or a method's assembled matrix, file)
Weights = Iterable[tuple[str, Any, str]]


@dataclass
class QuantPlan:
    """A load's quantization: ``config`` (None: unquantized), ``stream`` (regroups or filters
    the checkpoint's tensors), ``check`` (run once the model is built)."""

    config: QuantizationConfig | None = None
    stream: Callable[[Weights], Weights] | None = None
    check: Callable[[], None] | None = None

    def weights(self, weights: Weights) -> Weights:
        return weights if self.stream is None else self.stream(weights)

    def check_built(self) -> None:
        if self.check is not None:
            self.check()


def quantized_linears(model: nn.Module) -> dict[str, Linear]:
    """The model's linear layers stored in a quantized format, by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Linear) and not isinstance(m.fmt, UnquantizedFormat)
    }


@torch.no_grad()
def initialize_dummy_quantized(model: nn.Module, seed: int = 0) -> None:
    """Random weights for the quantized layers: each checkpoint matrix drawn like the dense
    dummy weights (normal, std 1 / sqrt(fan-in), on the device, in the model dtype), then
    quantized by the layer's own loader as a bf16 checkpoint's would be."""
    for name, module in quantized_linears(model).items():
        device, dtype, k = module.weight.device, module.compute_dtype, module.in_features
        spans = list(module.shards.items()) or [(None, (0, module.out_features))]
        for shard, (_, rows) in spans:
            seed_i = seed * 1_000_003 + zlib.crc32(f"{name}.weight:{shard}".encode())
            gen = torch.Generator(device=device).manual_seed(seed_i)
            w = torch.empty(rows, k, device=device, dtype=dtype)
            w.normal_(0.0, 1.0 / math.sqrt(k), generator=gen)
            module.weight.weight_loader(module.weight, w, shard)  # type: ignore[attr-defined]


def weight_memory(model: nn.Module) -> tuple[int, int, int]:
    """(bytes of the quantized layers' stored tensors, their count, bytes of everything else),
    as stored: parameters and persistent buffers."""
    layers = quantized_linears(model)
    quantized = sum(
        t.numel() * t.element_size() for m in layers.values() for t in m.state_dict().values()
    )
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return quantized, len(layers), total - quantized
