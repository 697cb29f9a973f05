"""Helpers for the OpenAI server tests: uvicorn servers on 127.0.0.1 (port 0, so the OS picks a
free one) in background threads, configured as ``vllm serve`` configures uvicorn; request bodies
with small PNG images; idle polling; a probe of the server's event-loop lag."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
import threading
import time
from dataclasses import dataclass
from typing import Any

import openai
import uvicorn

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.engine.cli_args import FlexibleArgumentParser
from vllm.entrypoints.openai.api_server import build_app, create_server_socket
from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.openai.http_limits import uvicorn_config

MODEL = "demo/mllama-tiny"
ENGINE_FLAGS = f"--model {MODEL} --max-model-len 512 --max-num-seqs 16 --disable-log-stats".split()


def parse_server_args(extra: list[str] | None = None) -> Any:
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args([*ENGINE_FLAGS, *(extra or [])])
    validate_parsed_serve_args(args)
    return args


def png_bytes(
    size: tuple[int, int] = (32, 24), color: tuple[int, int, int] = (200, 30, 60)
) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(
    size: tuple[int, int] = (32, 24), color: tuple[int, int, int] = (200, 30, 60)
) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(size, color)).decode()


def image_message(url: str, text: str = "What is in the image?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


@dataclass
class RunningServer:
    """A uvicorn server in a thread, serving an app over the shared test engine."""

    engine: AsyncLLMEngine
    app: Any
    server: uvicorn.Server
    thread: threading.Thread
    port: int
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "EMPTY", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kw
        )

    def async_client(self, api_key: str = "EMPTY") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(engine: AsyncLLMEngine, extra_args: list[str] | None = None) -> RunningServer:
    """Builds an app for ``engine`` and serves it on a free loopback port, with the uvicorn
    settings ``vllm serve`` uses (connection cap, header deadline, keep-alive)."""
    args = parse_server_args(extra_args)
    app = build_app(args, engine)
    sock = create_server_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn_config(app, app.state.ctx.limits, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.serve(sockets=[sock]))
        finally:
            loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(engine, app, server, thread, port, loop)


class LagProbe:
    """The longest stall of a server's event loop while the probe runs: a timer that re-arms
    itself every ``interval`` seconds records how late each run is. Leaving the probe waits
    for the loop to run once more, so a stall still in progress (or whose late timer has not
    run yet) is counted too."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float = 0.01) -> None:
        self.loop, self.interval = loop, interval
        self.max_lag = 0.0
        self._due: float | None = None
        self._running = False

    def _tick(self) -> None:
        now = self.loop.time()
        if self._due is not None:
            self.max_lag = max(self.max_lag, now - self._due)
        if self._running:
            self._due = now + self.interval
            self.loop.call_at(self._due, self._tick)

    def __enter__(self) -> LagProbe:
        self._running = True
        self.loop.call_soon_threadsafe(self._tick)
        return self

    def __exit__(self, *exc: object) -> None:
        finished: concurrent.futures.Future[None] = concurrent.futures.Future()

        def finish() -> None:
            self._running = False
            self._tick()
            finished.set_result(None)

        self.loop.call_soon_threadsafe(finish)
        finished.result(timeout=120)


def is_unauthorized(r: Any) -> bool:
    """The server's 401: OpenAI's error body (``AuthenticationError``) and the scheme to use."""
    if r.status_code != 401 or r.headers.get("www-authenticate") != "Bearer":
        return False
    err = r.json().get("error")
    return (
        isinstance(err, dict)
        and err.get("type") == "AuthenticationError"
        and err.get("code") == 401
        and "Unauthorized" in err.get("message", "")
    )


def wait_until_idle(engine: AsyncLLMEngine, timeout: float = 20.0) -> None:
    """Bounded polling until the engine has no requests and every KV page is free."""
    llm_engine = engine.engine
    pool = llm_engine.block_manager.pool
    deadline = time.monotonic() + timeout
    while llm_engine.has_unfinished_requests() or pool.usage() > 0.0:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"engine not idle after {timeout} s: usage {pool.usage()}, free {pool.num_free}"
            )
        time.sleep(0.02)
    llm_engine.check_integrity()
