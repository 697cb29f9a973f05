"""The routes clients call besides chat and completions: ``GET /v1/models/{id}`` (ids with
slashes, through the openai SDK), SageMaker's ``/ping`` and ``/invocations``, and the 401 in
OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai_server_utils import MODEL, RunningServer, is_unauthorized, start_server

from vllm.engine.async_llm_engine import AsyncLLMEngine

NAMES = ["org/tiny-vision", "alias"]


@pytest.fixture(scope="module")
def named(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine, ["--served-model-name", *NAMES])
    yield srv
    srv.stop()


def test_retrieve_model_with_a_slash(named: RunningServer) -> None:
    client = named.client()
    for name in NAMES:
        card = client.models.retrieve(name)  # the SDK sends org%2Ftiny-vision
        assert card.id == name and card.owned_by == "vllm"
        listed = next(c for c in client.models.list().data if c.id == name)
        assert card.model_dump(exclude={"created", "permission"}) == listed.model_dump(
            exclude={"created", "permission"}
        )
    raw = httpx.get(f"{named.url}/v1/models/org/tiny-vision").json()  # unencoded slash too
    assert raw["id"] == "org/tiny-vision" and raw["max_model_len"] == 512


def test_retrieve_unknown_model_is_a_404(named: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError):
        named.client().models.retrieve("org/other")
    for path in ("/v1/models/nope", "/v1/models/", "/v1/models/org/tiny-vision/x"):
        r = httpx.get(f"{named.url}{path}")
        assert r.status_code == 404, path
        err = r.json()["error"]
        assert (
            err["type"] == "NotFoundError"
            and err["code"] == 404
            and "does not exist" in (err["message"])
        ), path


def test_ping(server: RunningServer) -> None:
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert r.status_code == 200 and r.content == b"", method


def test_invocations_chat_and_completion(server: RunningServer) -> None:
    url = f"{server.url}/invocations"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    r = httpx.post(url, json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert r.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    completion = {"prompt": "Once", "max_tokens": 3, "temperature": 0}
    r = httpx.post(url, json=completion, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    with httpx.stream("POST", url, json={**completion, "stream": True}, timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [e for e in s.iter_lines() if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 2}, "must hold `messages`"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens: Input should be greater"),
        ({"messages": [], "max_tokens": 2}, "messages: List should have at least 1 item"),
        ({"prompt": "x", "model": "gpt-4"}, "The model `gpt-4` does not exist."),
        (b"[1, 2]", "must be a JSON object"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_invocations_errors(server: RunningServer, body: object, message: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/invocations", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == r.status_code


def test_unauthorized_body_is_openai_shaped(engine: AsyncLLMEngine) -> None:
    srv = start_server(engine, ["--api-key", "k3y"])
    try:
        for path in ("/v1/models", "/invocations"):
            r = httpx.post(f"{srv.url}{path}", json={"prompt": "x"})
            assert is_unauthorized(r), (path, r.text)
            assert r.json()["error"]["param"] is None
        with pytest.raises(openai.AuthenticationError) as exc:
            srv.client(api_key="wrong").models.retrieve(MODEL)
        assert "Unauthorized" in str(exc.value)
        assert srv.client(api_key="k3y").models.retrieve(MODEL).id == MODEL
        assert httpx.get(f"{srv.url}/ping").status_code == 200  # probes stay open
    finally:
        srv.stop()
