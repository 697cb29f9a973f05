"""Test-only reference for ``--kv-cache-dtype fp8``: HF transformers whose text attention (self
and cross) reads every K/V value rounded to an FP8 format with scale 1.0.

The rounding is written out here, independently of the engine: clamp to the format's largest
finite value, then cast (round to nearest even), then back to the model dtype. It is applied
to the keys and values handed to the attention function, after RoPE and the cross layers'
k_norm, for every query, prefill included: the semantics the engine documents. The vision
tower's attention is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def fp8_round(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(fp8).max
    return x.clamp(-limit, limit).to(fp8).to(x.dtype)


class _RoundingInterfaces:
    """Stands in for transformers' attention registry inside the mllama module."""

    def __init__(self, real, text_classes: tuple[type, ...], fp8: torch.dtype) -> None:
        self._real = real
        self._text = text_classes
        self._fp8 = fp8

    def get_interface(self, name, default):
        inner = self._real.get_interface(name, default)

        def attend(module, query, key, value, *args, **kwargs):
            if isinstance(module, self._text):
                key, value = fp8_round(key, self._fp8), fp8_round(value, self._fp8)
            return inner(module, query, key, value, *args, **kwargs)

        return attend

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextmanager
def fp8_kv_attention(fp8: torch.dtype = torch.float8_e4m3fn) -> Iterator[None]:
    """HF Mllama's text attention reads FP8-rounded K/V for the duration of the block."""
    import transformers.models.mllama.modeling_mllama as mm

    real = mm.ALL_ATTENTION_FUNCTIONS
    mm.ALL_ATTENTION_FUNCTIONS = _RoundingInterfaces(
        real, (mm.MllamaTextSelfAttention, mm.MllamaTextCrossAttention), fp8)
    try:
        yield
    finally:
        mm.ALL_ATTENTION_FUNCTIONS = real
