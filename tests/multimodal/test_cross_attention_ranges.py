"""Per-token image visibility (runs over images) against HF's dense cross-attention mask."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense,
    get_cross_attention_token_mask,
)

from vllm.multimodal.cross_attention import (
    ImageRun,
    count_image_tokens,
    image_groups,
    image_runs,
    last_group,
)
from vllm.multimodal.processing import ImageInputs, ProcessedInputs

IMG = 9


def _visible_sets(ids: list[int]) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in ids]
    for run in image_runs(ids, IMG):
        for t in range(run.tok_start, run.tok_end):
            out[t] = set(range(run.img_start, run.img_end))
    return out


def _hf_visible_sets(ids: list[int]) -> list[set[int]]:
    n_img = count_image_tokens(ids, IMG)
    masks = get_cross_attention_token_mask(ids, IMG)
    dense = convert_sparse_cross_attention_mask_to_dense([masks], [[1] * n_img], 1, len(ids))
    return [{i for i in range(n_img) if dense[0, t, i, 0]} for t in range(len(ids))]


def test_examples() -> None:
    #      0  1  2    3    4  5    6  7
    ids = [1, 2, IMG, IMG, 3, IMG, 4, 5]
    assert image_groups(ids, IMG) == [(2, 0, 2), (5, 2, 1)]
    assert image_runs(ids, IMG) == [ImageRun(2, 3, 0, 1), ImageRun(3, 4, 0, 2),
                                    ImageRun(4, 5, 0, 2), ImageRun(5, 6, 2, 3),
                                    ImageRun(6, 8, 2, 3)]
    assert last_group(ids, IMG) == (2, 3)
    assert image_runs([1, 2, 3], IMG) == [] and last_group([1, 2, 3], IMG) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([1, 2, IMG]), min_size=1, max_size=24))
def test_visibility_matches_hf(ids: list[int]) -> None:
    if count_image_tokens(ids, IMG) == 0:
        assert _visible_sets(ids) == [set() for _ in ids]
        return
    assert _visible_sets(ids) == _hf_visible_sets(ids)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([1, IMG]), min_size=1, max_size=16),
       st.lists(st.integers(1, 4), min_size=16, max_size=16))
def test_ranges_and_cached_group(ids: list[int], tiles: list[int]) -> None:
    """Image runs map to contiguous token ranges; the cached range is the last group."""
    import torch

    n = count_image_tokens(ids, IMG)
    tiles = tiles[:n]
    images = ImageInputs(torch.zeros(n, 4, 3, 2, 2), torch.ones(n, dtype=torch.long),
                         tiles) if n else None
    p = ProcessedInputs(ids, images, image_runs(ids, IMG), last_group(ids, IMG),
                        tokens_per_tile=5)
    offsets = p.image_token_offsets()
    assert offsets[-1] == 5 * sum(tiles) == p.num_vision_tokens
    if n == 0:
        assert p.encoder_seq_len == 0
        return
    lg0, lg1 = p.last_group
    assert p.cached_vision_range == (offsets[lg0], offsets[lg1])
    assert p.encoder_seq_len == 5 * sum(tiles[lg0:lg1])
    # What the last prompt token sees is exactly the cached group.
    last_run = image_runs(ids, IMG)[-1]
    if last_run.tok_end == len(ids):
        assert (last_run.img_start, last_run.img_end) == (lg0, lg1)
