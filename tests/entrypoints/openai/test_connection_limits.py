"""Connection limits: the body size counted as received (whatever the headers say), a
deadline for a request's headers and one for its body, idle keep-alive connections closed, and
a cap on open connections. Tiny limits are injected by flags; the attacks run beside ordinary
requests, which must come back unchanged (``attack_utils``)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from attack_utils import (
    BYSTANDER,
    closed_by_peer,
    json_body,
    raw_http,
    reference_text,
    run_attack,
    status_of,
)
from openai_server_utils import RunningServer, start_server

from vllm.engine.async_llm_engine import AsyncLLMEngine

FLAGS = ["--header-timeout", "0.3", "--body-timeout", "0.3", "--timeout-keep-alive", "0.3"]
GENEROUS = 5.0  # seconds: far above the 0.3 s deadlines, far below "never"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def strict(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine, FLAGS)
    yield srv
    srv.stop()


def _connect(srv: RunningServer, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=GENEROUS)
    if data:
        sock.sendall(data)
    return sock


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n", b"GET /health HTTP/1.1\r\nHo"],
    ids=["nothing", "half the headers", "a few bytes"],
)
def test_headers_must_arrive_in_time(strict: RunningServer, sent: bytes) -> None:
    async def attack(_: httpx.AsyncClient) -> list[bool]:
        socks = [_connect(strict, sent) for _ in range(3)]
        try:
            return list(await asyncio.gather(
                *(asyncio.to_thread(closed_by_peer, s, GENEROUS) for s in socks)))
        finally:
            for s in socks:
                s.close()

    closed, _ = run_attack(strict, attack)
    assert closed == [True, True, True]


def test_body_must_arrive_in_time(strict: RunningServer) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")

    async def attack(_: httpx.AsyncClient) -> bytes:
        return await raw_http(strict.port, head + b'{"prompt":', read_timeout=GENEROUS)

    reply, _ = run_attack(strict, attack)
    assert status_of(reply) == 408, reply[:200]
    assert "did not arrive within 0.3 s (--body-timeout)" in json_body(reply)["error"]["message"]


def test_idle_keep_alive_connections_are_closed(strict: RunningServer) -> None:
    sock = _connect(strict, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    try:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_by_peer(sock, GENEROUS)
    finally:
        sock.close()


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True  # nothing to read, and no EOF: open
    finally:
        sock.setblocking(True)


def test_connections_beyond_the_cap_are_closed(engine: AsyncLLMEngine) -> None:
    """With --limit-concurrency 4, a stream in flight and three idle connections fill the
    cap: a fifth connection is closed at once, the stream finishes unchanged."""
    srv = start_server(engine, ["--limit-concurrency", "4"])
    try:
        expected = reference_text(srv)

        async def run() -> tuple[str, bool, list[bool]]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                body = {**BYSTANDER, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.aiter_lines()
                    first = await anext(lines)
                    idle = [_connect(srv) for _ in range(3)]
                    extra = _connect(srv)
                    refused = await asyncio.to_thread(closed_by_peer, extra, GENEROUS)
                    still = [_still_open(s) for s in idle]
                    text = "".join(_delta(line) for line in [first, *[x async for x in lines]])
                    for s in (*idle, extra):
                        s.close()
            return text, refused, still

        text, refused, still = asyncio.run(run())
        assert refused and still == [True, True, True]
        assert text == expected
        assert reference_text(srv) == expected  # and new connections work again
    finally:
        srv.stop()


def _delta(line: str) -> str:
    if not line.startswith("data: {"):
        return ""
    return "".join(c["text"] for c in json.loads(line.removeprefix("data: "))["choices"])


@pytest.fixture
def small_body_server(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunningServer]:
    monkeypatch.setenv("VLLM_MAX_REQUEST_BODY_BYTES", str(64 << 10))
    srv = start_server(engine)
    yield srv
    srv.stop()


def test_body_limit_counts_the_bytes_received(small_body_server: RunningServer) -> None:
    """Content-Length says 10 while a chunked body of 100 KiB follows: the bytes count."""
    body = json.dumps({"messages": HI, "max_tokens": 2, "pad": "x" * (100 << 10)}).encode()
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 8192]), body[i : i + 8192])
        for i in range(0, len(body), 8192)
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    async def attack(_: httpx.AsyncClient) -> bytes:
        return await raw_http(small_body_server.port, head + chunks + b"0\r\n\r\n")

    reply, _ = run_attack(small_body_server, attack)
    assert status_of(reply) == 413, reply[:200]
    assert b"the limit is 65536 bytes" in reply
