"""Many concurrent mixed requests, and clients that disconnect (their pages come back)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from openai_server_utils import MODEL, RunningServer, image_message, png_data_url, wait_until_idle


async def _mixed_requests(server: RunningServer) -> list[Any]:
    client = server.async_client()
    image = png_data_url()

    async def chat(i: int) -> str:
        r = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"req {i}"}],
            max_tokens=6,
            temperature=0.7,
            seed=i,
        )
        return r.choices[0].finish_reason

    async def chat_image(i: int) -> str:
        r = await client.chat.completions.create(
            model=MODEL, messages=image_message(image, f"img {i}"), max_tokens=5
        )
        return r.choices[0].finish_reason

    async def stream(i: int) -> str:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"s {i}"}],
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        assert chunks[-1].usage is not None
        return chunks[-2].choices[0].finish_reason

    async def completion(i: int) -> str:
        r = await client.completions.create(
            model=MODEL, prompt=[f"c {i}", "d"], max_tokens=5, n=2, temperature=1.0
        )
        assert len(r.choices) == 4
        return r.choices[0].finish_reason

    async def bad(i: int) -> str:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2,
                temperature=-1.0,
            )
        return "rejected"

    kinds = [chat, chat_image, stream, completion, bad]
    try:
        return await asyncio.gather(*(kinds[i % len(kinds)](i) for i in range(20)))
    finally:
        await client.close()


def test_twenty_concurrent_mixed_requests(server: RunningServer) -> None:
    results = asyncio.run(_mixed_requests(server))
    assert len(results) == 20
    assert results.count("rejected") == 4
    assert all(r in ("stop", "length", "rejected") for r in results)
    wait_until_idle(server.engine)


def _success_count(server: RunningServer) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        if family.name == "vllm:request_success":
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def _hold_after_text(llm_engine: Any, monkeypatch: pytest.MonkeyPatch,
                     pieces: int) -> threading.Event:
    """Makes the engine wait, before each step, once its outputs have carried ``pieces``
    non-empty text deltas (what a server streams; a token can decode to no text), until the
    returned event is set (bounded): a request cannot finish behind the back of a client
    that is slow to read (a loaded CI machine)."""
    release = threading.Event()
    real_step = llm_engine.step
    seen = [0]

    def step():
        if not release.is_set() and seen[0] >= pieces:
            release.wait(timeout=30)
        outs = real_step()
        seen[0] += sum(1 for o in outs for c in o.outputs if c.text)
        return outs

    monkeypatch.setattr(llm_engine, "step", step)
    return release


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}], "n": 2}),
        ("/v1/completions", {"prompt": ["one", "two", "three"]}),
    ],
)
def test_disconnect_mid_stream_frees_pages(
    server: RunningServer, path: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    wait_until_idle(server.engine)
    pool = server.engine.engine.block_manager.pool
    free_before = pool.num_free
    successes = _success_count(server)
    body = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
    release = _hold_after_text(server.engine.engine, monkeypatch, 8)
    try:
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", f"{server.url}{path}", json=body) as r,
        ):
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if len(events) >= 4:
                    break
            # The request holds pages while it runs (the events say what happened if not).
            assert pool.num_free < free_before, events
    finally:
        release.set()  # disconnected: let the engine run (and see the abort)
    start = time.monotonic()
    wait_until_idle(server.engine, timeout=10)
    # Freed at once by the abort (the success count below says it did not finish).
    assert time.monotonic() - start < 5
    assert pool.num_free == free_before
    assert _success_count(server) == successes  # aborted, not finished


def test_disconnect_while_waiting_for_non_streamed_response(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    wait_until_idle(server.engine)
    successes = _success_count(server)
    body = {
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    # Held mid-way until the client has given up: a fast machine cannot finish first.
    release = _hold_after_text(server.engine.engine, monkeypatch, 8)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.5)
    finally:
        release.set()
    start = time.monotonic()
    wait_until_idle(server.engine, timeout=10)
    assert time.monotonic() - start < 5
    assert _success_count(server) == successes
