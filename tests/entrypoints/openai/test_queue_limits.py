"""The engine's waiting queue is bounded: past --max-queued-requests (or --max-queued-images
held by waiting requests) a request gets a 503 with Retry-After; the admitted ones complete.
The engine's steps are held so that admitted requests stay waiting, deterministically."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai_server_utils import image_message, png_data_url, start_server

from vllm.engine.async_llm_engine import AsyncLLMEngine


@pytest.fixture
def held_engine(engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The engine with its steps held until the test releases them: admitted requests wait."""
    release = threading.Event()
    step = engine.engine.step

    def held() -> Any:
        release.wait(timeout=60)
        return step()

    monkeypatch.setattr(engine.engine, "step", held)
    yield release
    release.set()


async def _wait_queued(engine: AsyncLLMEngine, requests: int) -> None:
    for _ in range(2000):  # bounded polling: admission happens within a few loop turns
        if engine.num_queued[0] >= requests:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"queued {engine.num_queued}, expected {requests} requests")


def test_waiting_queue_is_bounded(engine: AsyncLLMEngine, held_engine: threading.Event) -> None:
    srv = start_server(engine, ["--max-queued-requests", "2", "--max-queued-images", "1"])

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            image = {"messages": image_message(png_data_url()), "max_tokens": 2}
            first = asyncio.ensure_future(c.post("/v1/chat/completions", json=image))
            await _wait_queued(engine, 1)
            over_images = await c.post("/v1/chat/completions", json=image)
            second = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "a"}))
            await _wait_queued(engine, 2)
            over = await c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
            batch = await c.post("/v1/completions", json={"prompt": ["a"] * 3})
            held_engine.set()
            return [over_images, over, batch, await first, await second]

    try:
        over_images, over, batch, *waited = asyncio.run(run())
    finally:
        held_engine.set()
        srv.stop()
    for r, why in ((over_images, "--max-queued-images 1"), (over, "--max-queued-requests 2")):
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert why in r.json()["error"]["message"]
    assert batch.status_code == 400 and "more than 2" in batch.json()["error"]["message"]
    assert [r.status_code for r in waited] == [200, 200]
    assert engine.num_queued == (0, 0)
