"""Running an attack on a test server while ordinary requests run beside it: the bystanders
(greedy completions, whose text is known from a request sent alone) must come back 200 and
unchanged, ``/health`` must answer 200 throughout, and the server's event-loop lag is
measured (``LagProbe``). Every loop is bounded; nothing sleeps for a fixed time."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from openai_server_utils import LagProbe, RunningServer

T = TypeVar("T")
BYSTANDER = {
    "prompt": "The quick brown fox",
    "max_tokens": 6,
    "temperature": 0.0,
    "ignore_eos": True,
}
MAX_BYSTANDER_ROUNDS = 40


def reference_text(server: RunningServer) -> str:
    """The bystander's text when it runs alone."""
    r = httpx.post(f"{server.url}/v1/completions", json=BYSTANDER, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def under_attack(
    server: RunningServer, attack: Callable[[httpx.AsyncClient], Awaitable[T]]
) -> tuple[T, float]:
    """Runs ``attack(client)`` while bystanders run (at least one round, more while the attack
    lasts); returns the attack's result and the largest event-loop stall seen meanwhile."""
    expected = reference_text(server)
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def bystander() -> int:
            rounds = 0
            while rounds < 1 or (not done.is_set() and rounds < MAX_BYSTANDER_ROUNDS):
                r = await client.post("/v1/completions", json=BYSTANDER)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == expected
                assert (await client.get("/health")).status_code == 200
                rounds += 1
            return rounds

        with LagProbe(server.loop) as probe:
            task = asyncio.ensure_future(bystander())
            try:
                result = await attack(client)
            finally:
                done.set()
            assert await task >= 1
    return result, probe.max_lag


def run_attack(
    server: RunningServer, attack: Callable[[httpx.AsyncClient], Awaitable[T]]
) -> tuple[T, float]:
    return asyncio.run(under_attack(server, attack))


async def raw_http(port: int, data: bytes, read_timeout: float = 10.0) -> bytes:
    """Sends ``data`` on a fresh connection and reads until the server closes it (or the
    reply is complete); raises TimeoutError if the server neither answers nor closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(_read_reply(reader), read_timeout)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


async def _read_reply(reader: asyncio.StreamReader) -> bytes:
    reply = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            return reply
        reply += chunk
        head, sep, body = reply.partition(b"\r\n\r\n")
        if sep and b"content-length:" in head.lower():
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(body) >= length:
                return reply


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else 0


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` (reading EOF or a reset)."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def json_body(reply: bytes) -> Any:
    import json

    return json.loads(reply.partition(b"\r\n\r\n")[2])
