"""Test-only shim: makes transformers' Mllama follow Meta's reference in the two places where
transformers >= 4.56 differs (docs/architecture.md, "Model semantics"):

1. the vision encoder's intermediate features are the *inputs* of the listed layers;
2. text tokens that see no image get their cross-attention output zeroed too (not only the MLP).

The patch targets one transformers release; it refuses to apply to another, and checks the
signatures it replaces, so a behaviour change upstream fails loudly instead of silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

PINNED_TRANSFORMERS = "5.24.0"

_ENCODER_PARAMS = ["self", "hidden_states", "attention_mask"]
_XATTN_PARAMS = ["self", "hidden_states", "cross_attention_states", "cross_attention_mask",
                 "attention_mask", "full_text_row_masked_out_mask", "position_ids", "cache",
                 "use_cache", "position_embeddings", "kwargs"]


class ShimMismatch(RuntimeError):
    """The installed transformers is not the one the shim was written for."""


def _check() -> object:
    import transformers
    import transformers.models.mllama.modeling_mllama as mm

    if transformers.__version__ != PINNED_TRANSFORMERS:
        raise ShimMismatch(f"the Meta-parity shim targets transformers {PINNED_TRANSFORMERS}, "
                           f"found {transformers.__version__} (see constraints.txt)")
    enc = list(inspect.signature(mm.MllamaVisionEncoder.forward).parameters)
    xat = list(inspect.signature(mm.MllamaCrossAttentionDecoderLayer.forward).parameters)
    if enc != _ENCODER_PARAMS or xat != _XATTN_PARAMS:
        raise ShimMismatch(f"patched signatures changed: encoder {enc}, cross layer {xat}")
    return mm


def _encoder_forward(self, hidden_states, attention_mask=None):
    from transformers.modeling_outputs import BaseModelOutput

    inputs = []
    for layer in self.layers:
        inputs.append(hidden_states)  # Meta keeps the input of each layer
        hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
    return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=tuple(inputs))


def _cross_layer_forward(self, hidden_states, cross_attention_states, cross_attention_mask,
                         attention_mask, full_text_row_masked_out_mask, position_ids=None,
                         cache=None, use_cache=False, position_embeddings=None, **kwargs):
    residual = hidden_states
    attn, _ = self.cross_attn(hidden_states=self.input_layernorm(hidden_states),
                              attention_mask=cross_attention_mask,
                              cross_attention_states=cross_attention_states, cache=cache, **kwargs)
    if full_text_row_masked_out_mask is not None:
        attn = full_text_row_masked_out_mask[:, 0] * attn  # the branch HF leaves unmasked
    hidden_states = residual + self.cross_attn_attn_gate.tanh() * attn
    residual = hidden_states
    mlp = self.mlp(self.post_attention_layernorm(hidden_states))
    if full_text_row_masked_out_mask is not None:
        mlp = full_text_row_masked_out_mask[:, 0] * mlp
    return residual + self.cross_attn_mlp_gate.tanh() * mlp


@contextmanager
def meta_parity() -> Iterator[None]:
    """Applies the shim for the duration of the block, then restores transformers."""
    mm = _check()
    saved = (mm.MllamaVisionEncoder.forward, mm.MllamaCrossAttentionDecoderLayer.forward)
    mm.MllamaVisionEncoder.forward = _encoder_forward
    mm.MllamaCrossAttentionDecoderLayer.forward = _cross_layer_forward
    try:
        yield
    finally:
        mm.MllamaVisionEncoder.forward, mm.MllamaCrossAttentionDecoderLayer.forward = saved
