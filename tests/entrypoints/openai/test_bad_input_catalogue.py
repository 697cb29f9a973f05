"""Bad input, catalogued: each case is one request, the 4xx it must get and a piece of the
message that names the problem; then request bodies over the size limit, a property-based fuzz
of both generation endpoints (never a 5xx, always the OpenAI error shape), and a check that the
server is still healthy after all of it."""

from __future__ import annotations

import base64
import json
import logging
import math
import socket
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai_server_utils import (
    MODEL,
    RunningServer,
    image_message,
    is_unauthorized,
    png_bytes,
    start_server,
    wait_until_idle,
)

from vllm.engine.async_llm_engine import AsyncLLMEngine

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height``, with almost no pixel data behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 16)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


PNG = png_bytes((40, 40))


@dataclass
class Case:
    """One bad request: where it goes, what it sends, what must come back."""

    name: str
    body: Any  # JSON-able, or raw bytes sent as they are
    contains: str  # a piece of the error message
    status: int = 400
    path: str = CHAT_PATH
    target: str = "server"  # "server" (defaults), "open" (loopback + media dir allowed), "keyed"
    headers: dict[str, str] = field(default_factory=dict)


def chat(name: str, contains: str, status: int = 400, **fields: Any) -> Case:
    return Case(name, {"messages": HI, "max_tokens": 3, **fields}, contains, status)


def completion(name: str, contains: str, **fields: Any) -> Case:
    body = {"prompt": "hello", "max_tokens": 3, **fields}
    return Case(name, body, contains, path=COMPLETIONS_PATH)


def image(name: str, url: str, contains: str, **kw: Any) -> Case:
    return Case(name, {"messages": image_message(url), "max_tokens": 2}, contains, **kw)


def messages(name: str, value: Any, contains: str) -> Case:
    return Case(name, {"messages": value, "max_tokens": 3}, contains)


def raw(name: str, body: bytes, contains: str) -> Case:
    return Case(name, body, contains)


LONE_SURROGATE = b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 3}'
NAN_BODY = json.dumps({"messages": HI, "max_tokens": 3, "temperature": math.nan}).encode()
INF_BODY = NAN_BODY.replace(b"NaN", b"Infinity")
CONTEXT = "This model's maximum context length is 512 tokens. However, you requested"
TWO_IMAGES = [{"type": "image_url", "image_url": {"url": data_url(PNG)}}] * 2
CASES = [
    raw("malformed json", b'{"messages": [', "JSON decode error"),
    raw("body not an object", b"[1, 2]", "valid dictionary"),
    raw("invalid utf-8", b'{"messages": [{"role": "user", "content": "\xff"}]}', "not valid UTF-8"),
    raw("lone surrogate", LONE_SURROGATE, "contains a lone UTF-16 surrogate"),
    raw("NaN temperature", NAN_BODY, "temperature must be a number, got nan"),
    raw("infinite temperature", INF_BODY, "temperature must be finite, got inf"),
    messages("messages not a list", {"role": "user"}, "messages: Input should be a valid list"),
    messages("empty messages", [], "messages: List should have at least 1 item"),
    messages("message without role", [{"content": "x"}], "string 'role'"),
    messages("content a number", [{"role": "user", "content": 5}], "a string or a list of parts"),
    messages("unknown part", [{"role": "user", "content": [{"type": "audio"}]}], "unsupported"),
    messages("two images, limit one", [{"role": "user", "content": TWO_IMAGES}], "passed 2 image"),
    Case("messages missing", {"max_tokens": 3}, "messages: Field required"),
    chat("max_tokens a string", "max_tokens: Input should be a valid integer", max_tokens="x"),
    chat("max_tokens zero", "max_tokens: Input should be greater than or equal to 1", max_tokens=0),
    completion(
        "max_tokens negative",
        "max_tokens: Input should be greater than or equal to 0",
        max_tokens=-1,
    ),
    chat("max_tokens > max_model_len", CONTEXT, max_tokens=100_000),
    chat("negative temperature", "temperature must be non-negative", temperature=-0.5),
    chat("top_p zero", "top_p must be in (0, 1]", top_p=0.0),
    chat("top_p above one", "top_p must be in (0, 1]", top_p=1.5),
    chat("negative top_k", "top_k must be -1 (disable)", top_k=-5),
    chat("presence_penalty 2.5", "presence_penalty must be in [-2, 2]", presence_penalty=2.5),
    chat("frequency_penalty -3", "frequency_penalty must be in [-2, 2]", frequency_penalty=-3),
    chat("65 stop strings", "at most 64 are allowed", stop=[f"s{i}" for i in range(65)]),
    chat("6000 stop characters", "at most 4096 are allowed", stop=["x" * 3000, "y" * 3000]),
    chat("seed beyond int64", "seed: Input should be less than or equal to", seed=2**64),
    chat("n too large", "n=17 exceeds max_num_seqs (16)", n=17, temperature=1.0),
    chat("n > 1 greedy", "n must be 1 when using greedy", n=2, temperature=0.0),
    chat("top_logprobs 21", "exceeds the maximum of 20", logprobs=True, top_logprobs=21),
    chat("top_logprobs alone", "`logprobs` must be set to true", top_logprobs=2),
    chat("stream_options alone", "Stream options can only", stream_options={"include_usage": True}),
    chat(
        "include_usage a number",
        "stream_options.include_usage: Input should be a valid boolean",
        stream=True,
        stream_options={"include_usage": 1},
    ),
    chat("stream a string", "stream: Input should be a valid boolean", stream="true"),
    chat("n a string", "n: Input should be a valid integer", n="2"),
    chat("temperature a boolean", "temperature: Input should be a valid number", temperature=True),
    completion("prompt of booleans", "prompt must be a string, a list of strings", prompt=[True]),
    completion("prompt with an empty token list", "must not be empty", prompt=[[5], []]),
    completion("logit_bias key with a space", "keys must be token ids", logit_bias={" 5": 1}),
    chat(
        "allowed_token_ids 600", "allowed_token_ids contains token id 600", allowed_token_ids=[600]
    ),
    chat("unknown model", "The model `gpt-4` does not exist.", 404, model="gpt-4"),
    chat("unknown fields are ignored", "", 200, frobnicate=True, extra={"x": 1}),
    completion("logprobs 21", "exceeds the maximum of 20 (--max-logprobs)", logprobs=21),
    completion("prompt > max_model_len", f"{CONTEXT} 601 tokens in the messages", prompt="a" * 600),
    completion("prompt id 100000", "Token id 100000 is out of vocabulary", prompt=[1, 2, 100_000]),
    completion("negative prompt id", "Token id -1 is out of vocabulary", prompt=[[5, -1]]),
    completion("empty prompt", "The prompt must not be empty", prompt=[]),
    completion(
        "logit_bias 100000", "logit_bias contains token id 100000", logit_bias={"100000": 1}
    ),
    completion(
        "prompt_logprobs of <|image|>",
        "image token has no logit",
        prompt=[5, 515],
        prompt_logprobs=1,
    ),
    completion(
        "every allowed id suppressed",
        "no token could be sampled",
        allowed_token_ids=[0],
        stop_token_ids=[0],
        min_tokens=1,
    ),
    completion(
        "image token, no image", "image tokens (1) must be the same as", prompt="<|image|>x"
    ),
    image("truncated image", data_url(PNG[: len(PNG) // 2]), "image file is truncated"),
    image("zero-byte image", "data:image/png;base64,", "the image data is empty"),
    image("zero-width image", data_url(png_header(0, 5)), "cannot identify image file"),
    image("20k x 20k image", data_url(png_header(20_000, 20_000)), "The image is too large"),
    image("9k x 9k image", data_url(png_header(9_000, 9_000)), "9000x9000 = 81000000 pixels"),
    image("not an image", data_url(b"just some text"), "cannot identify image file"),
    image("text/plain data URL", data_url(PNG, "text/plain"), "Unsupported media type"),
    image("data URL not base64", "data:image/png,abcd", "Only base64-encoded"),
    image("bare base64", base64.b64encode(PNG).decode(), "Invalid image URL"),
    image("loopback URL", "http://127.0.0.1:9/x.png", "is not allowed"),
    image("private URL", "http://10.1.2.3/x.png", "is not allowed"),
    image("metadata URL", "http://169.254.169.254/latest/meta-data", "is not allowed"),
    image("file URL, no folder allowed", "file:///etc/hostname", "--allowed-local-media-path"),
    image("file URL outside the folder", "file:///etc/hostname", "subpath", target="open"),
    image("unreachable URL", f"http://127.0.0.1:{closed_port()}/x.png", "Failed", target="open"),
    image("image/jpeg label on a PNG is sniffed", data_url(PNG, "image/jpeg"), "", status=200),
    Case("missing bearer key", {"messages": HI}, "Unauthorized", 401, target="keyed"),
    Case(
        "wrong bearer key",
        {"messages": HI},
        "Unauthorized",
        401,
        target="keyed",
        headers={"Authorization": "Bearer nope"},
    ),
]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "pic.png").write_bytes(PNG)
    return d


@pytest.fixture(scope="module")
def servers(
    engine: AsyncLLMEngine, server: RunningServer, media_dir: Path
) -> Iterator[dict[str, RunningServer]]:
    hosts = ["--allowed-image-hosts", "127.0.0.1", "--allowed-local-media-path", str(media_dir)]
    opened, keyed = start_server(engine, hosts), start_server(engine, ["--api-key", "sekret"])
    yield {"server": server, "open": opened, "keyed": keyed}
    opened.stop()
    keyed.stop()


def send(
    srv: RunningServer, path: str, body: Any, headers: dict[str, str] | None = None
) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{srv.url}{path}", content=raw, headers=hdrs, timeout=30)


def assert_error_shape(r: httpx.Response) -> dict[str, Any]:
    """vLLM's (>= 0.10.1) error body: ``{"error": {message, type, param, code}}``."""
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == r.status_code and isinstance(err["message"], str)
    return err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_catalogue(servers: dict[str, RunningServer], case: Case) -> None:
    r = send(servers[case.target], case.path, case.body, case.headers)
    assert r.status_code == case.status, r.text
    if case.status == 200:
        return
    if case.status == 401:
        assert is_unauthorized(r), r.text
        return
    assert case.contains in assert_error_shape(r)["message"]


@pytest.mark.parametrize("kwargs", [{"documents": "not a list"}, {"date_string": 5}])
def test_chat_template_kwargs_of_the_wrong_type(
    server: RunningServer, kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # uvicorn logs the 500's traceback from its thread while pytest formats this failure: two
    # concurrent ast.parse calls can raise SystemError on CPython < 3.11.8 (gh-106905).
    monkeypatch.setattr(logging.getLogger("uvicorn.error"), "disabled", True)
    r = send(server, CHAT_PATH, {"messages": HI, "max_tokens": 2, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text


def test_catalogue_is_big_enough() -> None:
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


def test_body_over_the_default_limit_is_refused_from_its_header(server: RunningServer) -> None:
    """A 40 MiB Content-Length gets its 413 before a byte of the body is sent."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        head = (
            f"POST {CHAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {40 << 20}\r\n\r\n"
        )
        sock.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), reply
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == 413
    assert "the limit is 33554432 bytes (--max-request-body-bytes)" in body["error"]["message"]


def test_body_limit_with_and_without_content_length(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_MAX_REQUEST_BODY_BYTES", str(64 << 10))
    small = start_server(engine)
    try:
        url = f"{small.url}{CHAT_PATH}"
        big = json.dumps({"messages": HI, "max_tokens": 2, "pad": "x" * (100 << 10)}).encode()
        fits = json.dumps({"messages": HI, "max_tokens": 2, "pad": "x" * 1000}).encode()

        def chunked(data: bytes) -> Iterator[bytes]:  # no Content-Length: chunked encoding
            for i in range(0, len(data), 8192):
                yield data[i : i + 8192]

        for content in (big, chunked(big)):
            r = httpx.post(url, content=content, timeout=30)
            assert r.status_code == 413 and "too large" in assert_error_shape(r)["message"]
        for content in (fits, chunked(fits)):  # a buffered chunked body reaches the app intact
            r = httpx.post(url, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
    finally:
        small.stop()


def test_still_healthy_after_the_catalogue(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    wait_until_idle(server.engine)
