"""What a response may cost: the number of logprob entries it may carry is capped by a flag,
and large responses are built and encoded off the event loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai_server_utils import RunningServer, start_server

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def logprob_capped(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine, ["--max-logprob-entries", "100"])
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "path,body,entries",
    [
        ("/v1/chat/completions",
         {"messages": HI, "n": 2, "temperature": 1.0, "logprobs": True, "top_logprobs": 5}, 240),
        ("/v1/completions", {"prompt": ["a", "b"], "logprobs": 4}, 200),
        ("/v1/completions", {"prompt": [5] * 40, "prompt_logprobs": 2, "max_tokens": 1}, 120),
    ],
    ids=["chat n x top_logprobs", "completion batch", "prompt logprobs"],
)
def test_logprob_response_size_is_capped(
    logprob_capped: RunningServer, path: str, body: dict[str, Any], entries: int
) -> None:
    body = {"max_tokens": 20, **body}
    r = httpx.post(f"{logprob_capped.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"carry {entries} logprob entries" in message and "--max-logprob-entries" in message
    small = {"prompt": "a", "max_tokens": 2, "logprobs": 4}  # 2 x 5 entries
    r = httpx.post(f"{logprob_capped.url}/v1/completions", json=small, timeout=30)
    assert r.status_code == 200, r.text


def test_responses_are_built_off_the_event_loop(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building and encoding a large logprob response took seconds on the loop."""
    threads: list[threading.Thread] = []
    for cls in (OpenAIServingChat, OpenAIServingCompletion):
        original = cls._response

        def spy(self: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            threads.append(threading.current_thread())
            return _original(self, *args, **kw)

        monkeypatch.setattr(cls, "_response", spy)
    body = {"max_tokens": 3, "logprobs": True, "top_logprobs": 5, "messages": HI}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200
    body = {"max_tokens": 3, "logprobs": 5, "prompt": "hi"}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    assert len(threads) == 2 and server.thread not in threads
