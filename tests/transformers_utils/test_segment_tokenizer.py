"""Chat prompts tokenized piece by piece (``segment_tokenizer``) against the tokenizer itself."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import normalizers

from vllm.entrypoints.chat_utils import tokenize_chat_prompt
from vllm.transformers_utils import segment_tokenizer as seg_mod
from vllm.transformers_utils.demo_checkpoints import get_demo_checkpoint
from vllm.transformers_utils.demo_tokenizer import DemoCheckpointError
from vllm.transformers_utils.segment_tokenizer import MIN_CACHED_CHARS, SegmentTokenizer
from vllm.transformers_utils.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return get_tokenizer(get_demo_checkpoint("demo/mllama-tiny"))


def _reference(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


_SPECIALS = ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|image|>",
             "<|begin_of_text|>", "<|reserved_special_token_7|>"]  # fmt: skip
# Near misses of added tokens, whitespace runs, digits and non-ASCII text around the cuts.
_PIECES = st.one_of(
    st.sampled_from(_SPECIALS),
    st.sampled_from(["<|", "|>", "<|eot", "eot_id|>", "<<|image|>>", " ", "  ", "\n\n", "\t"]),
    st.text(alphabet="ab cdé\n 0123456789.,'ü😀", max_size=40),
    st.integers(0, 3).map(lambda k: ("long text of a message, " * 12)[k:]),  # > 128 chars
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_PIECES, max_size=14))
def test_equals_the_tokenizer_on_any_text(tiny_tokenizer, pieces) -> None:
    seg = SegmentTokenizer(tiny_tokenizer)
    assert seg.enabled
    text = "".join(pieces)
    ref = _reference(tiny_tokenizer, text)
    assert seg.encode(text) == ref
    assert seg.encode(text) == ref  # now with its long pieces from the cache


def test_a_resent_history_is_not_tokenized_again(tiny_tokenizer) -> None:
    seg = SegmentTokenizer(tiny_tokenizer)
    history = "A long message that a chat client sends on every turn. " * 20
    turn1 = f"<|start_header_id|>user<|end_header_id|>\n\n{history}<|eot_id|>"
    turn2 = turn1 + "<|start_header_id|>user<|end_header_id|>\n\nAnd a new question?<|eot_id|>"
    assert seg.encode(turn1) == _reference(tiny_tokenizer, turn1)
    misses = seg.misses
    assert seg.encode(turn2) == _reference(tiny_tokenizer, turn2)
    assert seg.misses == misses and seg.hits >= 1  # the history came from the cache


def test_salted_requests_share_no_piece(tiny_tokenizer) -> None:
    """A hit shows in timing: pieces are remembered per ``cache_salt``, as images and pages."""
    seg = SegmentTokenizer(tiny_tokenizer)
    text = "<|eot_id|>" + "a document every tenant might send " * 8
    ref = _reference(tiny_tokenizer, text)
    assert seg.encode(text, "tenant-a") == ref
    for salt in (None, "tenant-b"):
        misses = seg.misses
        assert seg.encode(text, salt) == ref
        assert seg.misses == misses + 1
    hits = seg.hits
    assert seg.encode(text, "tenant-a") == ref and seg.hits == hits + 1


def test_bounded_in_bytes(tiny_tokenizer) -> None:
    seg = SegmentTokenizer(tiny_tokenizer, max_bytes=4096)
    for i in range(40):
        text = f"<|eot_id|>message {i} " + "x y z " * 40
        assert seg.encode(text) == _reference(tiny_tokenizer, text)
        assert 0 < seg.num_bytes <= 4096


def test_other_tokenizers_are_called_whole(tiny_tokenizer) -> None:
    """With a normalizer the cut at added tokens is not the tokenizer's own: no pieces."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    seg = SegmentTokenizer(tok)
    assert not seg.enabled
    text = "ABC <|eot_id|>" + "Long Text " * 30
    assert seg.encode(text) == _reference(tok, text)
    assert seg.num_bytes == 0


def test_chat_prompts_use_it_unless_bos_is_asked_for(tiny_tokenizer) -> None:
    text = "<|start_header_id|>user<|end_header_id|>\n\n" + "words " * MIN_CACHED_CHARS
    seg = seg_mod.segment_tokenizer(tiny_tokenizer)
    before = seg.hits + seg.misses
    assert tokenize_chat_prompt(tiny_tokenizer, text) == _reference(tiny_tokenizer, text)
    assert seg.hits + seg.misses > before
    with_bos = list(tiny_tokenizer(text, add_special_tokens=True)["input_ids"])
    assert tokenize_chat_prompt(tiny_tokenizer, text, add_special_tokens=True) == with_bos


def test_the_llama3_tokenizer_of_the_full_size_demo() -> None:
    """The real Llama 3 tokenizer (shipped by the optional package llama-models)."""
    try:
        tok = get_tokenizer(get_demo_checkpoint("demo/mllama-11b"))
    except DemoCheckpointError as e:
        pytest.skip(str(e))
    seg = SegmentTokenizer(tok)
    assert seg.enabled
    history = "Hello there, how are you today? Ünïcode, 12345 digits, and  spaces.\n" * 30
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": history}]},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "And then?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = _reference(tok, text)
    assert seg.encode(text) == ref and seg.encode(text) == ref
