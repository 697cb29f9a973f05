"""``vllm serve`` with a timeline of each chat request, for finding where a short TTFT goes.

Usage: ``TIMELINE=timeline.json python -m benchmarks.profiling timeline MODEL [server args]``,
then send chat requests one at a time (``benchmarks.prefix_chat --concurrency 1``, say) and
stop the server (SIGTERM, Ctrl-C): the file gets one entry per request, each a list of
``[mark, seconds since the request reached the server]``:

- ``body_received``: the last byte of the request body read by the server;
- ``handler``: the route entered (FastAPI parsed and validated the body);
- ``prompt``: the messages rendered and tokenized, image sources resolved;
- ``inputs``: the images processed (or found in the processed-image cache);
- ``engine_add``: the request handed to the engine;
- ``scheduled``: its first prefill chunk scheduled;
- ``step``: every engine step until it finished, as ``["step", start, end, outputs]``;
- ``first_body``: the first response bytes sent (the stream's head).

Marks of overlapping requests would mix, so requests must not overlap (the tool says so
in the file: ``overlapped`` counts the requests that arrived while another was open).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
from typing import Any

requests: list[list[list[Any]]] = []
state = {"open": 0, "overlapped": 0}


def _mark(name: str, *extra: Any) -> None:
    if requests:
        t0 = requests[-1][0][1]
        requests[-1].append([name, time.perf_counter() - t0, *extra])


def dump() -> None:
    """Writes the timeline to ``$TIMELINE``."""
    entries = [[m for m in r[1:]] for r in requests]
    with open(os.environ["TIMELINE"], "w") as f:
        json.dump({"requests": entries, "overlapped": state["overlapped"]}, f)


def _asgi(app: Any) -> Any:
    """Wraps the app's middleware stack: arrival, body received, first response body."""
    build = app.build_middleware_stack

    def stack() -> Any:
        inner = build()

        async def timed(scope, receive, send):
            if scope["type"] != "http" or not scope["path"].endswith("/completions"):
                return await inner(scope, receive, send)
            state["overlapped"] += state["open"] > 0
            state["open"] += 1
            requests.append([["arrival", time.perf_counter()]])
            sent = False

            async def recv():
                message = await receive()
                if message.get("type") == "http.request" and not message.get("more_body"):
                    _mark("body_received")
                return message

            async def snd(message):
                nonlocal sent
                if message.get("type") == "http.response.body" and not sent:
                    sent = True
                    _mark("first_body")
                await send(message)

            try:
                return await inner(scope, recv, snd)
            finally:
                state["open"] -= 1

        return timed

    app.build_middleware_stack = stack
    return app


def _after(cls: type, name: str, mark: str) -> None:
    """Marks ``mark`` when the coroutine method ``cls.name`` returns."""
    fn = getattr(cls, name)

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        finally:
            _mark(mark)

    setattr(cls, name, wrapper)


def install() -> None:
    """Patches the server and the engine so that every chat request records its timeline."""
    from vllm.engine.llm_engine import LLMEngine
    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat

    build_app = api_server.build_app
    api_server.build_app = lambda args, engine: _asgi(build_app(args, engine))
    chat = OpenAIServingChat.create_chat_completion

    @functools.wraps(chat)
    async def handler(self, *args, **kwargs):
        _mark("handler")
        return await chat(self, *args, **kwargs)

    OpenAIServingChat.create_chat_completion = handler
    _after(OpenAIServingChat, "_prepare", "prompt")
    _after(OpenAIServingChat, "process", "inputs")
    add_request = LLMEngine.add_request

    @functools.wraps(add_request)
    def add(self, *args, **kwargs):
        _mark("engine_add")
        return add_request(self, *args, **kwargs)

    LLMEngine.add_request = add
    mark_scheduled = LLMEngine._mark_scheduled

    def scheduled(out):
        if any(c.seq.request.first_scheduled_time is None for c in out.chunks):
            _mark("scheduled")
        return mark_scheduled(out)

    LLMEngine._mark_scheduled = staticmethod(scheduled)
    step = LLMEngine.step

    @functools.wraps(step)
    def traced(self):
        start = time.perf_counter()
        out = step(self)
        if requests and state["open"]:
            t0 = requests[-1][0][1]
            requests[-1].append(["step", start - t0, time.perf_counter() - t0, len(out)])
        return out

    LLMEngine.step = traced


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Installs the hooks, then runs ``vllm serve`` with the remaining arguments."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if "TIMELINE" not in os.environ:
        raise SystemExit(
            f"usage: TIMELINE=FILE {prog or 'serve_timeline'} MODEL [server args]"
            "\n\nset TIMELINE to the timeline file to write"
        )
    install()
    atexit.register(dump)
    from vllm.entrypoints.cli.main import main as cli

    cli(["serve", *(argv or [])])
