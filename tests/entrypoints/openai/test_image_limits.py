"""Images on the server: the pixel cap's default (near what the model uses) and its flag, the
deadline for all images of one request, and a redirect to a ``data:`` URL, which is a client
error. Slow and redirecting image hosts are local servers; deadlines are injected tiny (the
decoding and fetching rules themselves: tests/multimodal/test_image_fetch.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from attack_utils import run_attack
from helpers.image_hosts import image_hosts
from openai_server_utils import RunningServer, image_message, png_bytes, start_server
from test_bad_input_catalogue import data_url, png_header

from vllm.engine.async_llm_engine import AsyncLLMEngine

GENEROUS = 5.0  # seconds: far above the injected deadlines


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[int, ...]]:
    """Two image hosts on loopback: their ports."""
    with image_hosts(2) as ports:
        yield ports


def _chat(srv: RunningServer, url: str) -> httpx.Response:
    body = {"messages": image_message(url), "max_tokens": 2}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)


def test_default_pixel_cap_is_near_what_the_model_uses(server: RunningServer) -> None:
    async def attack(c: httpx.AsyncClient) -> httpx.Response:
        body = {"messages": image_message(data_url(png_header(8192, 8192))), "max_tokens": 2}
        return await c.post("/v1/chat/completions", json=body)

    r, _ = run_attack(server, attack)
    assert r.status_code == 400, r.text
    assert "more than the limit of 16777216 pixels" in r.json()["error"]["message"]


def test_pixel_cap_is_a_flag(engine: AsyncLLMEngine) -> None:
    srv = start_server(engine, ["--max-image-pixels", "1000"])
    try:
        assert _chat(srv, data_url(png_bytes((20, 20)))).status_code == 200
        r = _chat(srv, data_url(png_bytes((40, 40))))
        assert r.status_code == 400 and "1600 pixels, more than the limit of 1000" in r.text
    finally:
        srv.stop()


def test_request_deadline_covers_its_images(engine: AsyncLLMEngine, hosts: tuple[int, int]) -> None:
    flags = ["--allowed-image-hosts", "127.0.0.1", "--image-fetch-request-timeout", "0.3"]
    srv = start_server(engine, flags)
    try:
        async def attack(c: httpx.AsyncClient) -> httpx.Response:
            body = {"messages": image_message(f"http://127.0.0.1:{hosts[0]}/slow"),
                    "max_tokens": 2}
            return await c.post("/v1/chat/completions", json=body)

        r, _ = run_attack(srv, attack)
        assert r.status_code == 400, r.text
        assert "images after 0.3 s (--image-fetch-request-timeout)" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_redirect_to_a_data_url_is_a_400(engine: AsyncLLMEngine, hosts: tuple[int, int]) -> None:
    srv = start_server(engine, ["--allowed-image-hosts", "127.0.0.1"])
    try:
        target = "data:image/png;base64," + "iVBORw0KGgo="
        r = _chat(srv, f"http://127.0.0.1:{hosts[0]}/to?u={target}")
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("Invalid redirect fetching image from"), message
    finally:
        srv.stop()
