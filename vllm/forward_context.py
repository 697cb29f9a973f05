"""A scoped context that hands the per-step attention metadata to the attention layers.

The model's ``forward(input_ids, positions, ...)`` stays HF-shaped; only attention layers read
the context. Nesting is refused: a step inside a step is always a bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm.attention.metadata import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Installs ``metadata`` for the duration of one forward pass."""
    global _current
    if _current is not None:
        raise RuntimeError("set_forward_context: a forward context is already active")
    _current = metadata
    try:
        yield
    finally:
        _current = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention metadata requested outside set_forward_context()")
    return _current
