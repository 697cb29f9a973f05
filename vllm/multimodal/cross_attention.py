"""Which images each text token sees, as runs of tokens over contiguous runs of images.

Rules (Meta's reference): consecutive ``<|image|>`` tokens form a group. The k-th image token
of a group sees images 1..k of the group; tokens after the group see the whole group, up to the
next group's first image token (or the end, for the last group, including generated tokens).
Tokens before the first image see nothing. Every token therefore sees one contiguous run of
images, so one contiguous range of the request's packed vision tokens: no dense masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageRun:
    """Tokens ``[tok_start, tok_end)`` see images ``[img_start, img_end)``."""

    tok_start: int
    tok_end: int
    img_start: int
    img_end: int


def image_positions(token_ids: Sequence[int], image_token_id: int) -> list[int]:
    """Positions of the image tokens, found by ``index`` (a scan in C: a chat's history is
    thousands of tokens and holds a few images)."""
    positions: list[int] = []
    pos = -1
    while True:
        try:
            pos = token_ids.index(image_token_id, pos + 1)
        except ValueError:
            return positions
        positions.append(pos)


def image_groups(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int, int]]:
    """Groups of consecutive image tokens as (first position, first image index, image count)."""
    groups: list[tuple[int, int, int]] = []
    prev = -2
    for n_images, pos in enumerate(image_positions(token_ids, image_token_id)):
        if pos == prev + 1:
            start, first, count = groups[-1]
            groups[-1] = (start, first, count + 1)
        else:
            groups.append((pos, n_images, 1))
        prev = pos
    return groups


def image_runs(token_ids: Sequence[int], image_token_id: int) -> list[ImageRun]:
    """The runs of tokens that see at least one image, in token order."""
    groups = image_groups(token_ids, image_token_id)
    runs: list[ImageRun] = []
    for g, (pos, first, count) in enumerate(groups):
        for k in range(count):
            runs.append(ImageRun(pos + k, pos + k + 1, first, first + k + 1))
        end = groups[g + 1][0] if g + 1 < len(groups) else len(token_ids)
        if end > pos + count:
            runs.append(ImageRun(pos + count, end, first, first + count))
    return runs


def last_group(token_ids: Sequence[int], image_token_id: int) -> tuple[int, int] | None:
    """Image index range of the last group (what generated tokens see), or None."""
    groups = image_groups(token_ids, image_token_id)
    if not groups:
        return None
    _, first, count = groups[-1]
    return first, first + count


def count_image_tokens(token_ids: Sequence[int], image_token_id: int) -> int:
    return token_ids.count(image_token_id)
