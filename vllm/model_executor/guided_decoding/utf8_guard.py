"""Keeps constrained output valid UTF-8 at the byte level.

xgrammar matches code points through a lenient UTF-8 decoder: with byte-level tokens a
pattern can accept an overlong form (``E0 8F 95`` for U+03D5) or a surrogate (``ED A0 80``),
which are not UTF-8 and reach the client as replacement characters. The guard tracks where
each sequence's output bytes stand in a UTF-8 character (one of eight decoder states) and
clears, in the grammar's mask, every token whose bytes would be invalid from there. The
per-state token masks are computed once per vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# A decoder state: (continuation bytes still expected, allowed range of the next one).
State = tuple[int, int, int]
GROUND: State = (0, 0, 0)
_ANY: State = (1, 0x80, 0xBF)
STATES: tuple[State, ...] = (
    GROUND,
    _ANY,
    (2, 0xA0, 0xBF),  # after E0 (no overlong three-byte forms)
    (2, 0x80, 0xBF),
    (2, 0x80, 0x9F),  # after ED (no surrogates)
    (3, 0x90, 0xBF),  # after F0 (no overlong four-byte forms)
    (3, 0x80, 0xBF),
    (3, 0x80, 0x8F),  # after F4 (nothing above U+10FFFF)
)
_INDEX = {s: i for i, s in enumerate(STATES)}


def _lead(byte: int) -> State | None:
    if byte < 0x80:
        return GROUND
    if 0xC2 <= byte <= 0xDF:
        return _ANY
    if byte == 0xE0:
        return (2, 0xA0, 0xBF)
    if byte == 0xED:
        return (2, 0x80, 0x9F)
    if 0xE1 <= byte <= 0xEF:
        return (2, 0x80, 0xBF)
    if byte == 0xF0:
        return (3, 0x90, 0xBF)
    if 0xF1 <= byte <= 0xF3:
        return (3, 0x80, 0xBF)
    if byte == 0xF4:
        return (3, 0x80, 0x8F)
    return None


def advance(state: State, data: bytes) -> State | None:
    """The state after ``data`` from ``state``; ``None`` if the bytes are not valid there."""
    for byte in data:
        left, low, high = state
        if left == 0:
            nxt = _lead(byte)
            if nxt is None:
                return None
            state = nxt
        elif low <= byte <= high:
            state = (left - 1, 0x80, 0xBF) if left > 1 else GROUND
        else:
            return None
    return state


class Utf8Guard:
    """Per-state token masks (xgrammar's bitmask layout) for one vocabulary."""

    def __init__(self, vocab: Sequence[bytes], vocab_size: int) -> None:
        self.vocab = list(vocab[:vocab_size])
        words = (vocab_size + 31) // 32
        allowed = np.zeros((len(STATES), words * 32), dtype=bool)
        for token_id, data in enumerate(self.vocab):
            if not data:  # special and stop tokens: the grammar alone decides
                allowed[:, token_id] = True
            elif data[0] < 0x80 or _lead(data[0]) is not None:
                allowed[0, token_id] = advance(GROUND, data) is not None
            else:  # starts with a continuation byte
                for i, state in enumerate(STATES[1:], 1):
                    allowed[i, token_id] = advance(state, data) is not None
        self.masks = np.packbits(allowed, axis=1, bitorder="little").view("<i4").copy()

    def state_after(self, state: State, token_id: int) -> State:
        """The state after an accepted token (one the mask allowed)."""
        data = self.vocab[token_id] if token_id < len(self.vocab) else b""
        return advance(state, data) or GROUND

    def restrict(self, bitmask: np.ndarray, row: int, state: State) -> None:
        """Clears in ``bitmask[row]`` (a host array: numpy, not a torch op per row) the tokens
        that are not valid UTF-8 from ``state``."""
        np.bitwise_and(bitmask[row], self.masks[_INDEX[state]], out=bitmask[row])
