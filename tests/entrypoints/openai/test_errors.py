"""Error responses: status codes, OpenAI-style bodies and vLLM's messages; the API key."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai_server_utils import (
    MODEL,
    RunningServer,
    image_message,
    is_unauthorized,
    parse_server_args,
    png_data_url,
    start_server,
)

from vllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from vllm.entrypoints.openai.api_server import build_app

CHAT = [{"role": "user", "content": "hi"}]


def _post(server: RunningServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def _assert_error(r: httpx.Response, status: int, err_type: str, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == err_type and err["code"] == status
    assert contains in err["message"], err["message"]
    return err


def test_validation_error_is_400_not_422(server: RunningServer) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"})
    err = _assert_error(r, 400, "BadRequestError", "max_tokens")
    assert err["param"] == "max_tokens"
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    _assert_error(r, 400, "BadRequestError")
    _assert_error(
        _post(server, "/v1/chat/completions", {"max_tokens": 3}), 400, "BadRequestError", "messages"
    )


def test_bad_temperature(client: openai.OpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=-0.5)
    assert exc.value.status_code == 400 and "temperature" in exc.value.message
    # The SDK refuses to encode NaN; Python clients with allow_nan (and curl) can send it.
    raw = json.dumps({"messages": CHAT, "max_tokens": 2, "temperature": math.nan})
    assert "NaN" in raw
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    _assert_error(r, 400, "BadRequestError", "temperature")


@pytest.mark.parametrize(
    "body,contains",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"n": 2, "temperature": 0.0}, "greedy"),
        ({"n": 17, "stream": True}, "exceeds max_num_seqs (16)"),
        ({"top_logprobs": 3}, "`logprobs` must be set to true"),
        ({"stream_options": {"include_usage": True}}, "Stream options can only be defined"),
        ({"logprobs": True, "top_logprobs": 50}, "--max-logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format type 'xml'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
            "requires --enable-auto-tool-choice",
        ),
    ],
)
def test_invalid_request_fields(server: RunningServer, body: dict, contains: str) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **body})
    _assert_error(r, 400, "BadRequestError", contains)


def test_unknown_model_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    assert exc.value.status_code == 404
    assert exc.value.body["message"] == "The model `gpt-4` does not exist."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_too_many_images(server: RunningServer) -> None:
    url = png_data_url()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "two"},
            ],
        }
    ]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    _assert_error(
        r,
        400,
        "BadRequestError",
        "You set image=1 (or defaulted to 1) in `--limit-mm-per-prompt`, but passed "
        "2 image items in the same prompt.",
    )


@pytest.mark.parametrize(
    "url,contains",
    [
        ("data:image/png;base64,!!!notbase64!!!", "Invalid base64"),
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "Failed to load the image"),
        ("iVBORw0KGgo=", "Invalid image URL"),
        ("file:///etc/passwd", "--allowed-local-media-path"),
        ("ftp://example.com/x.png", "Invalid image URL"),
    ],
)
def test_bad_images(server: RunningServer, url: str, contains: str) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": image_message(url), "max_tokens": 2})
    _assert_error(r, 400, "BadRequestError", contains)


def test_system_message_with_image(server: RunningServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *image_message(png_data_url())]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    _assert_error(
        r, 400, "BadRequestError", "Prompting with images is incompatible with system messages."
    )


def test_image_token_count_mismatch(server: RunningServer) -> None:
    r = _post(server, "/v1/completions", {"prompt": "<|image|>describe", "max_tokens": 2})
    _assert_error(
        r,
        400,
        "BadRequestError",
        "The number of image tokens (1) must be the same as the number of images (0)",
    )


def test_prompt_too_long(server: RunningServer) -> None:
    r = _post(server, "/v1/completions", {"prompt": "a" * 600, "max_tokens": 2})
    _assert_error(
        r,
        400,
        "BadRequestError",
        "This model's maximum context length is 512 "
        "tokens. However, you requested 601 tokens in the messages, Please reduce "
        "the length of the messages.",
    )
    r = _post(server, "/v1/completions", {"prompt": "a" * 9, "max_tokens": 505})
    _assert_error(
        r,
        400,
        "BadRequestError",
        "This model's maximum context length is 512 "
        "tokens. However, you requested 515 tokens (10 in the messages, 505 in the "
        "completion). Please reduce the length of the messages or completion.",
    )
    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "b" * 600}], "max_tokens": 2},
    )
    _assert_error(r, 400, "BadRequestError", "maximum context length is 512 tokens")


def test_bad_request_does_not_disturb_others(client: openai.OpenAI) -> None:
    good = client.completions.create(model=MODEL, prompt="ok", max_tokens=3, temperature=0.0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**7], max_tokens=2)
    again = client.completions.create(model=MODEL, prompt="ok", max_tokens=3, temperature=0.0)
    assert again.choices[0].text == good.choices[0].text


@pytest.fixture(scope="module")
def keyed_server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine, ["--api-key", "sekret"])
    yield srv
    srv.stop()


def test_api_key(keyed_server: RunningServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.get(f"{keyed_server.url}/v1/models", headers=headers)
        assert is_unauthorized(r)
    with pytest.raises(openai.AuthenticationError):
        keyed_server.client(api_key="bad").models.list()
    assert keyed_server.client(api_key="sekret").models.list().data[0].id == MODEL
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.url}/metrics").status_code == 200


class _DeadEngine:
    """Delegates to the real engine but reports itself dead."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def check_health(self) -> None:
        raise EngineDeadError("engine loop died: test")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        async def gen() -> Any:
            raise EngineDeadError("engine loop died: test")
            yield

        return gen()


def test_dead_engine_maps_to_5xx(engine: AsyncLLMEngine) -> None:
    app = build_app(parse_server_args(), _DeadEngine(engine))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    stream_body = {"messages": CHAT, "max_tokens": 2, "stream": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [
                await c.get("/health"),
                await c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}),
                await c.post("/v1/chat/completions", json=stream_body),
            ]

    health, chat, stream = asyncio.run(run())
    assert health.status_code == 503
    _assert_error(chat, 500, "InternalServerError", "engine loop died")
    # After the 200 header the error goes in-band, then [DONE].
    assert stream.status_code == 200
    events = [e for e in stream.text.split("\n\n") if e]
    assert events[0].startswith("data: {") and '"role":"assistant"' in events[0]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "engine loop died" in error["message"]
    assert events[-1] == "data: [DONE]"
