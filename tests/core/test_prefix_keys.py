"""Prefix-cache keys against an independent oracle: HF's cross-attention token mask says which
images each token sees, and two prompts must share page i exactly when every token of pages
0..i is equal and sees the same images (by digest)."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

from vllm.core.prefix_keys import (
    PageKeyChain,
    chain_for,
    chain_root,
    cross_group_key,
    cross_key_for,
    images_seen,
    max_cached_pages,
    page_keys,
)
from vllm.multimodal.cross_attention import image_runs, last_group
from vllm.multimodal.processing import ImageInputs, ProcessedInputs

IMG = 9
BLOCK = 4
DIGESTS = [hashlib.sha256(bytes([i])).digest() for i in range(3)]


def seen_by_token(ids: list[int], digests: list[bytes]) -> list[tuple[bytes, ...]]:
    """Per token, the digests of the images it sees (HF's mask: image j is seen by tokens
    [start, end), end -1 meaning the end of the sequence)."""
    spans = get_cross_attention_token_mask(list(ids), IMG)
    out = []
    for t in range(len(ids)):
        out.append(tuple(
            digests[j] for j, (s, e) in enumerate(spans) if s <= t < (len(ids) if e == -1 else e)
        ))  # fmt: skip
    return out


prompt_tokens = st.lists(st.sampled_from([1, 2, IMG]), min_size=1, max_size=14)


@st.composite
def prompt_pair(draw):
    """Two prompts that often share a prefix (B is A with a few edits), with images drawn
    from a small pool so that equal images are common."""
    a = draw(prompt_tokens)
    b = list(a)
    for _ in range(draw(st.integers(0, 2))):
        pos = draw(st.integers(0, len(b)))
        op = draw(st.sampled_from(["set", "insert", "cut"]))
        tok = draw(st.sampled_from([1, 2, IMG]))
        if op == "set" and pos < len(b):
            b[pos] = tok
        elif op == "insert":
            b.insert(pos, tok)
        else:
            b = b[:pos] or [1]
    da = [draw(st.sampled_from(DIGESTS)) for _ in range(a.count(IMG))]
    db = [draw(st.sampled_from(DIGESTS)) for _ in range(b.count(IMG))]
    n = min(len(da), len(db))
    if draw(st.booleans()):  # the same images where both have them, most of the time
        db[:n] = da[:n]
    salts = draw(st.sampled_from([(None, None), ("s", "s"), (None, "s"), ("s", "t")]))
    return a, da, b, db, salts


@settings(max_examples=400, deadline=None)
@given(prompt_pair())
def test_pages_shared_exactly_when_tokens_and_seen_images_agree(pair) -> None:
    a, da, b, db, (sa, sb) = pair
    ka = page_keys(a, len(a), IMG, da, BLOCK, sa)
    kb = page_keys(b, len(b), IMG, db, BLOCK, sb)
    assert len(ka) == len(a) // BLOCK and len(set(ka)) == len(ka)
    va, vb = seen_by_token(a, da), seen_by_token(b, db)
    for i in range(min(len(ka), len(kb))):
        end = (i + 1) * BLOCK
        same = sa == sb and a[:end] == b[:end] and va[:end] == vb[:end]
        assert (ka[i] == kb[i]) == same, (i, a, b)
    # Keys never coincide across positions (the same tokens one page later are another page).
    assert all(x != y for i, x in enumerate(ka) for j, y in enumerate(kb) if i != j)


def test_text_before_the_image_is_shared_and_the_image_page_is_not() -> None:
    system = [1, 2, 1, 2, 2, 1, 1, 2]  # two full pages that see no image
    a = [*system, IMG, 1, 1, 1]
    ka = page_keys(a, len(a), IMG, [DIGESTS[0]], BLOCK)
    kb = page_keys(a, len(a), IMG, [DIGESTS[1]], BLOCK)  # same ids, another image
    kt = page_keys([*system, 2, 1, 1, 1], 12, IMG, [], BLOCK)  # no image at all
    assert ka[:2] == kb[:2] == kt[:2]
    assert ka[2] != kb[2] and ka[2] != kt[2]


def test_salt_separates_every_page_and_group() -> None:
    ids = [1, 2, IMG, 2, 1, 1, 2, 2]
    plain = page_keys(ids, 8, IMG, DIGESTS[:1], BLOCK)
    s1 = page_keys(ids, 8, IMG, DIGESTS[:1], BLOCK, "tenant-1")
    s2 = page_keys(ids, 8, IMG, DIGESTS[:1], BLOCK, "tenant-2")
    assert not (set(plain) & set(s1)) and not (set(s1) & set(s2))
    assert s1 == page_keys(ids, 8, IMG, DIGESTS[:1], BLOCK, "tenant-1")
    assert chain_root(BLOCK, None) != chain_root(BLOCK, "") != chain_root(BLOCK + 1, "")
    g = [cross_group_key(DIGESTS[:2], s) for s in (None, "tenant-1", "tenant-2")]
    assert len(set(g)) == 3


def test_cross_group_key_is_the_images_in_order() -> None:
    ab = cross_group_key([DIGESTS[0], DIGESTS[1]], None)
    assert ab == cross_group_key([DIGESTS[0], DIGESTS[1]], None)
    assert ab != cross_group_key([DIGESTS[1], DIGESTS[0]], None)
    assert ab != cross_group_key([DIGESTS[0]], None)
    assert ab != cross_group_key([DIGESTS[0], DIGESTS[1], DIGESTS[1]], None)


def test_output_pages_extend_the_chain_and_match_the_next_turn() -> None:
    """A sequence's output pages, keyed as decode fills them, equal the pages of a next turn
    that resends those tokens as its prompt; output tokens never introduce images."""
    prompt = [1, IMG, 2, 2, 1, 1]
    chain = PageKeyChain(BLOCK, len(prompt), IMG, DIGESTS[:1])
    tokens = list(prompt)
    assert len(chain.update(tokens)) == 1
    for t in [2, 2, IMG, 1, 1]:  # generated (an image id here introduces nothing)
        tokens.append(t)
        chain.update(tokens)
    assert len(chain.keys) == 2
    turn2 = [*tokens[:8], 5, 5, 5, 5]
    with_image_token_in_prompt = page_keys(turn2, len(turn2), IMG, DIGESTS[:1], BLOCK)
    assert chain.keys == with_image_token_in_prompt[:2]
    sibling = chain.fork()
    tokens.extend([3, 3, 3])
    assert sibling.update(tokens) == chain.update(tokens) and sibling.keys == chain.keys


def test_limits_and_seen_images() -> None:
    assert [max_cached_pages(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]
    ids = [1, IMG, IMG, 2, 2, IMG, 1, 1]  # group (0, 1) at 1..2, image 2 at 5
    runs = image_runs(ids, IMG)
    assert images_seen(runs, 0, 1) == (0, 0)
    assert images_seen(runs, 1, 2) == (0, 1)  # the first image token sees its image only
    assert images_seen(runs, 2, 5) == (0, 2)
    assert images_seen(runs, 4, 8) == (0, 3)
    assert images_seen(runs, 6, 8) == (2, 3)  # only the last group: a cached cross group


def test_keys_of_processed_inputs() -> None:
    """A request's chain and cross key come from its inputs: the digests of its images, its
    last group and its salt."""
    import torch

    ids = [1, IMG, 2, IMG, IMG, 1, 2, 2]
    images = ImageInputs(torch.zeros(3, 1), torch.ones(3, dtype=torch.long), [1, 1, 1],
                         digests=DIGESTS)  # fmt: skip
    inputs = ProcessedInputs(ids, images, image_runs(ids, IMG), last_group(ids, IMG),
                             image_token_id=IMG, cache_salt="t")  # fmt: skip
    assert chain_for(inputs, BLOCK).update(ids) == page_keys(ids, 8, IMG, DIGESTS, BLOCK, "t")
    assert cross_key_for(inputs) == cross_group_key(DIGESTS[1:3], "t")
    text = ProcessedInputs([1, 2, 3, 4], runs=[], last_group=None, image_token_id=IMG)
    assert cross_key_for(text) is None and len(chain_for(text, BLOCK).update([1, 2, 3, 4])) == 1
