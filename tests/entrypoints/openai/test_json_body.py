"""Request bodies are read by ``routes.parse_json_body``: exactly what ``json.loads`` reads,
or ``json.loads``'s own error (hypothesis, on valid documents and on corrupted ones), and the
chat, completion and SageMaker routes go through it."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_server_utils import RunningServer

from vllm.entrypoints.openai import routes
from vllm.entrypoints.openai.routes import parse_json_body


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (NaN equal to NaN, 1 not 1.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# Text with every code point, lone surrogates included (json.dumps escapes them).
_TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)
_SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | _TEXT
)
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(doc=_DOCS, ascii_only=st.booleans(), spaced=st.booleans())
def test_documents_read_as_json_loads_reads_them(doc: Any, ascii_only: bool,
                                                 spaced: bool) -> None:
    text = json.dumps(doc, ensure_ascii=ascii_only, indent=1 if spaced else None)
    try:
        body = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written raw cannot be sent as UTF-8
        body = text.encode("utf-8", "surrogatepass")
    expected = _outcome(body)
    assert _same(_outcome_of(parse_json_body, body), expected), body[:200]


def _outcome_of(parse: Any, body: bytes) -> Any:
    try:
        return ("ok", parse(body))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return ("error", type(e).__name__, str(e))


def _outcome(body: bytes) -> Any:
    return _outcome_of(json.loads, body)


@settings(max_examples=300, deadline=None)
@given(doc=_DOCS, data=st.data())
def test_corrupted_bodies_fail_as_json_loads_fails(doc: Any, data: st.DataObject) -> None:
    body = bytearray(json.dumps(doc).encode())
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(body)))
        piece = data.draw(st.sampled_from([b",", b"]", b"}", b'"', b"\\", b"\\ud800", b"\xff",
                                           b"\xef\xbb\xbf", b"\n", b"NaN", b"-", b"0", b" "]))
        if data.draw(st.booleans()) and at < len(body):
            del body[at]
        else:
            body[at:at] = piece
    assert _same(_outcome_of(parse_json_body, bytes(body)), _outcome(bytes(body))), bytes(body)


@pytest.mark.parametrize(
    "body",
    [b"\xef\xbb\xbf{\"a\": 1}", '{"a": 1}'.encode("utf-16"), b'{"a": "x\\ud800"}',
     b'{"a": NaN, "b": -Infinity}', b'{"a": 1, "a": 2}', b"{\"a\": 1}x", b'{"a": "\xff"}'],
)
def test_edges_of_the_two_parsers(body: bytes) -> None:
    """A BOM and UTF-16 (json.loads detects them), a lone surrogate escape, non-finite
    numbers, a repeated key, trailing data, invalid UTF-8."""
    assert _same(_outcome_of(parse_json_body, body), _outcome(body))


def test_routes_read_bodies_through_it(server: RunningServer,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(body: bytes) -> Any:
        calls.append(len(body))
        return parse_json_body(body)

    monkeypatch.setattr(routes, "parse_json_body", counted)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    for path, body in (("/v1/chat/completions", chat), ("/invocations", chat),
                       ("/v1/completions", {"prompt": "Once", "max_tokens": 2})):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
    assert len(calls) == 3
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [', timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON decode error" in r.json()["error"]["message"]
