"""What error messages and open endpoints must not tell a client: resolved paths (symlink
targets, the process id, the working folder), whether another client's request id is in use,
an exception's repr; and which endpoints follow --api-key."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai_server_utils import (
    RunningServer,
    image_message,
    is_unauthorized,
    png_bytes,
    start_server,
)

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

KEY = "sekret"


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("leaks")
    (root / "media").mkdir()
    (root / "hidden-target.png").write_bytes(png_bytes())
    (root / "media" / "link.png").symlink_to(root / "hidden-target.png")
    return root


@pytest.fixture(scope="module")
def media_server(engine: AsyncLLMEngine, media: Path) -> Iterator[RunningServer]:
    srv = start_server(engine, ["--allowed-local-media-path", str(media / "media")])
    yield srv
    srv.stop()


def test_file_errors_name_no_resolved_path(media_server: RunningServer, media: Path) -> None:
    secrets = [str(Path.cwd()), f"/proc/{os.getpid()}", str(media / "hidden-target.png"),
               str(media / "media")]
    for url in ("file:///proc/self/cwd/setup.py", (media / "media" / "link.png").as_uri(),
                (media / "media" / "missing.png").as_uri(), "file:///proc/self/environ"):
        body = {"messages": image_message(url), "max_tokens": 2}
        r = httpx.post(f"{media_server.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert not [s for s in secrets if s in message], message


def test_request_ids_of_other_clients_are_not_confirmed(server: RunningServer) -> None:
    """Two clients choosing the same request_id both get their answer."""

    async def run() -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            body = {"prompt": "a", "max_tokens": 30, "ignore_eos": True, "request_id": "same"}
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                lines = s.aiter_lines()
                await anext(lines)  # the first request is in the engine now
                second = await c.post("/v1/completions", json={**body, "max_tokens": 2})
                async for _ in lines:
                    pass
                return s.status_code, second.status_code

    assert asyncio.run(run()) == (200, 200)


@pytest.fixture(scope="module")
def keyed(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine, ["--api-key", KEY])
    yield srv
    srv.stop()


def test_tokenizer_endpoints_follow_the_api_key(keyed: RunningServer) -> None:
    calls = [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})]
    for path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{keyed.url}{path}", json=body, headers=headers, timeout=30)
            assert is_unauthorized(r), path
        ok = httpx.post(f"{keyed.url}{path}", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
    assert httpx.get(f"{keyed.url}/metrics").status_code == 200  # open unless asked


def test_metrics_can_require_the_key(engine: AsyncLLMEngine) -> None:
    srv = start_server(engine, ["--api-key", KEY, "--enable-metrics-auth"])
    try:
        assert httpx.get(f"{srv.url}/metrics").status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{srv.url}/metrics", headers=auth).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()


def test_unexpected_errors_do_not_show_their_repr(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def boom(self: Any, request: Any) -> Any:
        raise RuntimeError("secret detail at /srv/internal/path")

    monkeypatch.setattr(OpenAIServingTokenization, "create_detokenize", boom)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [5]}, timeout=30)
    assert r.status_code == 500
    assert "/srv/internal" not in r.text and "secret" not in r.text
    assert r.json()["error"]["message"].startswith("Internal server error (RuntimeError;")
