"""A scoped context that hands per-step state to the layers: the attention metadata, and the
row bucket whose kernels the linear layers run.

The model's ``forward(input_ids, positions, ...)`` stays HF-shaped; only attention layers read
the metadata and only linear layers the bucket. Nesting is refused: a step inside a step is
always a bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm.attention.metadata import AttentionMetadata

# Kernel-table index for any row count (prefill, the vision tower, work outside a step): the
# last entry of every table (see ``model_executor/layers/kernel_target.py``).
ANY_ROWS = -1

_current: AttentionMetadata | None = None
_row_bucket = ANY_ROWS


_active = False


@contextmanager
def set_forward_context(
    metadata: AttentionMetadata | None, row_bucket: int = ANY_ROWS
) -> Iterator[None]:
    """Installs ``metadata`` (None: a forward without attention, such as one MLP in a test)
    and the decode ``row_bucket`` index (``ANY_ROWS`` otherwise) for one forward pass."""
    global _current, _row_bucket, _active
    if _active:
        raise RuntimeError("set_forward_context: a forward context is already active")
    _current, _row_bucket, _active = metadata, row_bucket, True
    try:
        yield
    finally:
        _current, _row_bucket, _active = None, ANY_ROWS, False


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention metadata requested outside set_forward_context()")
    return _current


def row_bucket() -> int:
    """The kernel-table index of the running step (``ANY_ROWS`` outside a decode step)."""
    return _row_bucket
