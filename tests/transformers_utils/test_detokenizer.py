"""Incremental detokenization: equal to a full decode, UTF-8 split across tokens, stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vllm.transformers_utils.detokenizer import (
    IncrementalDetokenizer,
    detokenize_logprob_tokens,
)

EMOJI = "😀"
# Multi-byte pieces: whole characters, halves of characters, and a token that ends one
# character and starts the next (byte 0xAD ends 中, then ASCII "a").
MERGED = [
    " the",
    " world",
    "ing",
    "hello",
    "中文".encode(),
    "中".encode()[:2],
    EMOJI.encode()[:2],
    EMOJI.encode()[2:],
    EMOJI.encode(),
    b"\xada",
    "é".encode(),
    "\ufffd".encode(),
    "<|",
]
SPECIAL = ["<|eot_id|>", "<|begin_of_text|>"]
ADDED = ["<tool>"]


def byte_alphabet() -> dict[int, str]:
    """The GPT-2 byte-to-character table that byte-level BPE vocabularies are written in."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer() -> PreTrainedTokenizerFast:
    table = byte_alphabet()
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {table[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for piece in MERGED:
        data = piece.encode() if isinstance(piece, str) else piece
        current = table[data[0]]
        for byte in data[1:]:
            if current + table[byte] not in vocab:
                merges.append((current, table[byte]))
                vocab[current + table[byte]] = len(vocab)
            current += table[byte]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    backend.add_tokens([AddedToken(t, special=False) for t in ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)
TEXT = st.text(
    alphabet=st.sampled_from(
        list("ab hello world the ing,.\n") + ["中", "文", "é", EMOJI, "\ufffd"]
    ),
    max_size=40,
)


def feed(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] = ()
) -> tuple[str, str | None]:
    """Feeds ``ids`` in chunks of the given sizes (1 by default); returns (streamed, stop)."""
    streamed, position, sizes = [], 0, list(chunks)
    while position < len(ids) and not detok.finished:
        size = sizes.pop(0) if sizes else 1
        result = detok.add_tokens(ids[position : position + size])
        streamed.append(result.new_text)
        assert detok.output_text == "".join(streamed)
        position += size
        if result.stop_string is not None:
            return "".join(streamed), result.stop_string
    streamed.append(detok.flush().new_text)
    return "".join(streamed), None


def test_tokenizer_has_multibyte_and_special_tokens() -> None:
    ids = TOKENIZER.encode(f"hello 中文 {EMOJI}<|eot_id|>", add_special_tokens=False)
    pieces = [TOKENIZER.decode([i]) for i in ids]
    assert "\ufffd" in pieces  # some tokens hold part of a character
    assert TOKENIZER.convert_tokens_to_ids("<|eot_id|>") in ids


@settings(max_examples=250, deadline=None, database=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=30),
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    chunks=st.lists(st.integers(1, 4), max_size=10),
    skip=st.booleans(),
)
def test_random_ids_match_full_decode(
    ids: list[int], prompt: list[int], chunks: list[int], skip: bool
) -> None:
    detok = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip)
    streamed, position, sizes = "", 0, list(chunks)
    while position < len(ids):
        size = sizes.pop(0) if sizes else 1
        streamed += detok.add_tokens(ids[position : position + size]).new_text
        position += size
        so_far = TOKENIZER.decode(ids[:position], skip_special_tokens=skip)
        assert so_far.startswith(streamed)  # released text is final
        if not so_far.endswith("\ufffd"):
            assert streamed == so_far  # nothing held back needlessly
    streamed += detok.flush().new_text
    assert streamed == detok.output_text == TOKENIZER.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None, database=None)
@given(text=TEXT)
def test_unicode_text_round_trips(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    streamed, stop = feed(IncrementalDetokenizer(TOKENIZER, []), ids)
    assert stop is None and streamed == text


def test_split_characters_wait_for_their_last_byte() -> None:
    ids = TOKENIZER.encode(f"a{EMOJI}", add_special_tokens=False)
    assert len(ids) == 3  # "a", first half, second half
    detok = IncrementalDetokenizer(TOKENIZER, [])
    assert [detok.add_tokens([i]).new_text for i in ids] == ["a", "", EMOJI]


def test_window_stays_short() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, list(range(100)))
    sizes: list[int] = []
    decode = detok._decode
    detok._decode = lambda ids: sizes.append(len(ids)) or decode(ids)  # type: ignore[method-assign]
    text = " the world" * 150 + f"中{EMOJI}é" * 50
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    assert feed(detok, ids)[0] == text
    assert len(ids) > 400 and max(sizes) <= 6


def test_prompt_context_and_special_tokens() -> None:
    prompt = TOKENIZER.encode("<|begin_of_text|>hello", add_special_tokens=False)
    ids = TOKENIZER.encode(" world<|eot_id|>", add_special_tokens=False)
    assert feed(IncrementalDetokenizer(TOKENIZER, prompt), ids)[0] == " world"
    kept = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=False)
    assert feed(kept, ids)[0] == " world<|eot_id|>"


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected", "fired"),
    [
        ("hello world, the end", ["o w"], False, "hell", "o w"),
        ("hello world, the end", ["o w"], True, "hello w", "o w"),
        ("hello world, the end", ["end", "the"], False, "hello world, ", "the"),
        ("hello world", ["lo w", "o"], False, "hell", "o"),  # "o" completes first
        ("say 中文 now", ["文 n"], False, "say 中", "文 n"),
        (f"x {EMOJI}{EMOJI} y", [f"{EMOJI} y"], False, f"x {EMOJI}", f"{EMOJI} y"),
        (f"x {EMOJI}{EMOJI} y", [EMOJI], True, f"x {EMOJI}", EMOJI),
        ("hello world", ["zzz"], False, "hello world", None),
    ],
)
def test_stop_strings(
    text: str, stop: list[str], include: bool, expected: str, fired: str | None
) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=stop, include_stop_str_in_output=include)
    streamed, got = feed(detok, ids)
    assert (streamed, got) == (expected, fired)
    assert detok.output_text == expected and detok.finished


def test_stop_string_on_special_token_text() -> None:
    ids = TOKENIZER.encode("hello<|eot_id|> world", add_special_tokens=False)
    kept = IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=False, stop=["eot_id"])
    assert feed(kept, ids) == ("hello<|", "eot_id")
    skipped = IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=True, stop=["eot_id"])
    assert feed(skipped, ids) == ("hello world", None)


def test_held_characters_are_released_on_flush_and_check_stop_false() -> None:
    ids = TOKENIZER.encode("ab the world", add_special_tokens=False)
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=["the world!"])
    streamed = "".join(detok.add_tokens([i]).new_text for i in ids)
    assert streamed == "ab the world"[: -len("the world!") + 1]  # a possible stop is held
    assert detok.flush().new_text == "ab the world"[len(streamed) :]
    assert detok.output_text == "ab the world"
    with pytest.raises(RuntimeError):
        detok.add_tokens([1])
    ignoring = IncrementalDetokenizer(TOKENIZER, [], stop=["the"])
    assert ignoring.add_tokens(ids, check_stop=False).stop_string is None


def reference_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Where a character-by-character stream would stop: the match that ends first."""
    best = None
    for s in stop:
        index = text.find(s)
        if index >= 0 and (best is None or (index + len(s), index) < best[:2]):
            best = (index + len(s), index, s)
    if best is None:
        return text, None
    end, start, s = best
    return text[: end if include else start], s


@settings(max_examples=200, deadline=None, database=None)
@given(
    text=TEXT,
    stop=st.lists(
        st.text(alphabet=list("ab hel.中文") + [EMOJI], min_size=1, max_size=4), max_size=3
    ),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), max_size=10),
)
def test_stop_strings_match_a_character_stream(
    text: str, stop: list[str], include: bool, chunks: list[int]
) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(TOKENIZER, [], stop=stop, include_stop_str_in_output=include)
    assert feed(detok, ids, chunks) == reference_stop(text, stop, include)


def test_detokenize_logprob_tokens() -> None:
    ids = [*TOKENIZER.encode(f" the 中{EMOJI}", add_special_tokens=False), VOCAB - 1, VOCAB - 2]
    assert detokenize_logprob_tokens(TOKENIZER, ids) == [TOKENIZER.decode([i]) for i in ids]
    assert detokenize_logprob_tokens(TOKENIZER, ids[:1]) == [" the"]


def _byte_tokens() -> list[int]:
    """Ids of the single-byte tokens (the 256 base entries of the byte-level vocabulary)."""
    table = byte_alphabet()
    return [TOKENIZER.convert_tokens_to_ids(table[b]) for b in range(256)]


@pytest.mark.parametrize("stream", ["continuation bytes", "lead byte then specials"])
@pytest.mark.parametrize("skip", [True, False])
def test_invalid_bytes_do_not_grow_the_window(stream: str, skip: bool) -> None:
    """Streams whose text never ends on a clean boundary (lone UTF-8 continuation bytes; an
    unfinished character followed only by special tokens): the window is still cut, so each
    step decodes a bounded number of tokens, and the text equals the full decode."""
    import random

    rng = random.Random(5)
    bytes_ = _byte_tokens()
    specials = [TOKENIZER.convert_tokens_to_ids(t) for t in SPECIAL]
    if stream == "continuation bytes":
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.choice(bytes_[0x80:0xC0])
               for _ in range(2000)]
    else:
        ids = [bytes_[0xE4]] + [rng.choice(specials) for _ in range(2000)]
    detok = IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=skip)
    sizes: list[int] = []
    decode = detok._decode
    detok._decode = lambda ids: sizes.append(len(ids)) or decode(ids)  # type: ignore[method-assign]
    assert feed(detok, ids)[0] == TOKENIZER.decode(ids, skip_special_tokens=skip)
    assert max(sizes) <= 80  # not ~2,000


@settings(max_examples=200, deadline=None, database=None)
@given(
    ids=st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(_byte_tokens()[0x80:])),
                 max_size=60),
    chunks=st.lists(st.integers(1, 4), max_size=10),
    skip=st.booleans(),
)
def test_window_cuts_keep_the_text_exact(ids: list[int], chunks: list[int], skip: bool) -> None:
    """With cuts tried after every 2 pending tokens, the released text is still always final
    and the whole equals the full decode (random ids, biased to invalid bytes)."""
    import vllm.transformers_utils.detokenizer as module

    old = module._MAX_PENDING_TOKENS
    module._MAX_PENDING_TOKENS = 2
    try:
        detok = IncrementalDetokenizer(TOKENIZER, [], skip_special_tokens=skip)
        streamed, position, sizes = "", 0, list(chunks)
        while position < len(ids):
            size = sizes.pop(0) if sizes else 1
            streamed += detok.add_tokens(ids[position : position + size]).new_text
            position += size
            assert TOKENIZER.decode(ids[:position], skip_special_tokens=skip).startswith(streamed)
        streamed += detok.flush().new_text
    finally:
        module._MAX_PENDING_TOKENS = old
    assert streamed == TOKENIZER.decode(ids, skip_special_tokens=skip)
