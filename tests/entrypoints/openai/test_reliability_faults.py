"""Faults: one request failing (a corrupt image, an error injected while the engine adds it, a
sampling error inside a batched step), the engine loop dying, and SIGTERM to ``vllm serve``
with streams in flight. Every wait is bounded: a hang fails the test instead of stalling it.

The port-in-use message is covered by ``test_cli.py::test_port_in_use``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.server_process import free_port, wait_healthy
from openai_server_utils import (
    RunningServer,
    image_message,
    png_bytes,
    start_server,
    wait_until_idle,
)
from test_reliability_load import Job, check_results, engine_with, run_job, sampled_job

CHAT = [{"role": "user", "content": "hi"}]
MARKER_SEED = 987_654_321


def good_jobs(count: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = [sampled_job(rng, i) for i in range(count)]
    for j in jobs[::2]:
        j.body.update(stream=True, stream_options={"include_usage": True})
    return jobs


async def with_good_jobs(server: RunningServer, jobs: list[Job], *bad: Any) -> list[Any]:
    """Runs ``jobs`` (checked) alongside the ``bad(client)`` coroutines; returns the latter's
    results."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        out = await asyncio.gather(*(run_job(client, j) for j in jobs), *(b(client) for b in bad))
    assert check_results(jobs, list(out[: len(jobs)]), [], {}) == len(jobs)
    return list(out[len(jobs) :])


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


def in_band_error(text: str) -> dict[str, Any]:
    """The error event of a stream that failed after its 200 header (then ``[DONE]``)."""
    events = sse_events(text)
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["error"]


def test_corrupt_image_fails_alone(server: RunningServer) -> None:
    png = png_bytes((40, 40))
    truncated = "data:image/png;base64," + base64.b64encode(png[: len(png) // 2]).decode()

    def corrupt(stream: bool) -> Any:
        async def send(client: httpx.AsyncClient) -> httpx.Response:
            body = {"messages": image_message(truncated), "max_tokens": 4, "stream": stream}
            return await client.post("/v1/chat/completions", json=body)

        return send

    bad = [corrupt(stream=i % 2 == 0) for i in range(4)]
    for r in asyncio.run(with_good_jobs(server, good_jobs(12, seed=1), *bad)):
        assert r.status_code == 400
        assert "Failed to load the image: image file is truncated" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_until_idle(server.engine)


def test_error_while_adding_one_request_fails_it_alone(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception for one request inside the engine thread (a 500 for it, in-band
    when streamed); the engine and the requests around it carry on."""
    llm_engine = server.engine.engine
    real_add = llm_engine.add_request

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        if "poison" in request_id:
            raise RuntimeError(f"injected failure for {request_id}")
        real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(llm_engine, "add_request", add_request)

    def poisoned(i: int, stream: bool) -> Any:
        async def send(client: httpx.AsyncClient) -> tuple[bool, httpx.Response]:
            body = {"messages": CHAT, "max_tokens": 6, "stream": stream, "request_id": f"poison{i}"}
            return stream, await client.post("/v1/chat/completions", json=body)

        return send

    bad = [poisoned(i, stream=i % 2 == 0) for i in range(4)]
    for stream, r in asyncio.run(with_good_jobs(server, good_jobs(12, seed=2), *bad)):
        if stream:
            assert r.status_code == 200
            err = in_band_error(r.text)
        else:
            assert r.status_code == 500
            err = r.json()["error"]
        # The client learns the error's type; its message (here naming the request) is logged.
        assert err["code"] == 500 and "Internal server error (RuntimeError;" in err["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_until_idle(server.engine)


@pytest.fixture()
def own_server() -> Iterator[RunningServer]:
    """A server over an engine of its own, for tests that may kill the engine loop."""
    engine = engine_with()
    srv = start_server(engine)
    yield srv
    srv.stop()
    engine.shutdown()


def test_sampling_failure_in_a_batched_step_fails_only_its_request(
    own_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling raises for one request inside a batched step: that request fails (a 500, in-band
    when streamed); the requests batched with it complete and every page comes back."""
    runner = own_server.engine.engine.runner
    real_rows = runner._sampling_rows

    def sampling_rows(seqs: list[Any]) -> Any:
        if any(s.request.params.seed == MARKER_SEED for s in seqs):
            raise RuntimeError("injected sampling failure")
        return real_rows(seqs)

    monkeypatch.setattr(runner, "_sampling_rows", sampling_rows)

    def marked(stream: bool) -> Any:
        async def send(client: httpx.AsyncClient) -> tuple[bool, httpx.Response]:
            body = {"messages": CHAT, "max_tokens": 6, "temperature": 1.0, "seed": MARKER_SEED}
            return stream, await client.post(
                "/v1/chat/completions", json={**body, "stream": stream}
            )

        return send

    bad = [marked(stream=False), marked(stream=True)]
    for stream, r in asyncio.run(with_good_jobs(own_server, good_jobs(8, seed=3), *bad)):
        assert r.status_code == (200 if stream else 500), r.text
        err = in_band_error(r.text) if stream else r.json()["error"]
        assert err["code"] == 500 and "Internal server error (RuntimeError;" in err["message"]
    assert httpx.get(f"{own_server.url}/health", timeout=5).status_code == 200
    wait_until_idle(own_server.engine)


def test_engine_loop_failure_is_5xx_never_a_hang(
    own_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def step() -> list[Any]:
        raise RuntimeError("injected engine step failure")

    monkeypatch.setattr(own_server.engine.engine, "step", step)
    url = own_server.url
    chat = {"messages": CHAT, "max_tokens": 4}
    with httpx.Client(base_url=url, timeout=10) as c:  # a hang raises ReadTimeout
        first = c.post("/v1/chat/completions", json={**chat, "stream": True})
        assert first.status_code in (200, 500)  # the loop may die before or after the header
        err = in_band_error(first.text) if first.status_code == 200 else first.json()["error"]
        assert err["code"] == 500 and "injected engine step failure" in err["message"]
        assert c.get("/health").status_code == 503
        for path, body in [
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", {**chat, "stream": True}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
        ]:
            r = c.post(path, json=body)
            assert r.status_code == 500, (path, body, r.text)
            err = r.json()["error"]
            assert err["type"] == "InternalServerError" and "engine loop died" in err["message"]
        assert c.get("/health").status_code == 503
        assert c.get("/v1/models").status_code == 200  # the HTTP side itself is fine


VLLM = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_API_KEY": ""}


_free_port, _wait_healthy = free_port, wait_healthy


class _Client(threading.Thread):
    """One request in a thread: its SSE payloads (or JSON body), status, and transport error."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.events: list[str] = []
        self.status: int | None = None
        self.json: Any = None
        self.error: str | None = None
        self.started = threading.Event()  # sent; for a stream, two events arrived

    def run(self) -> None:
        try:
            if not self.body.get("stream"):
                self.started.set()
                r = httpx.post(self.url + self.path, json=self.body, timeout=30)
                self.status, self.json = r.status_code, r.json()
                return
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=30) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        if len(self.events) >= 2:
                            self.started.set()
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self.started.set()


def _running(url: str) -> float:
    """``vllm:num_requests_running`` from /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _check_outcome(c: _Client, drain: bool, max_tokens: int) -> None:
    """Drained: complete, with all its tokens. Aborted: a clean 500 error, in-band if streamed."""
    assert not c.is_alive() and c.error is None, c.error
    if c.json is not None:  # not streamed
        if drain:
            assert c.status == 200 and c.json["usage"]["completion_tokens"] == max_tokens
        else:
            assert c.status == 500 and "engine" in c.json["error"]["message"]
        return
    assert c.status == 200 and c.events[-1] == "[DONE]", c.events[-2:]
    last = json.loads(c.events[-2])
    if drain:
        choices = {ch["index"] for e in c.events[:-1] for ch in json.loads(e).get("choices", [])}
        assert last["usage"]["completion_tokens"] == max_tokens * len(choices)
    else:
        assert last["error"]["code"] == 500 and "engine" in last["error"]["message"]


@pytest.mark.parametrize("shutdown_timeout", [0, 30])
def test_sigterm_with_requests_in_flight(shutdown_timeout: int) -> None:
    """SIGTERM: new connections are refused at once; with ``--shutdown-timeout 0`` the requests
    in flight end straight away with a clean error (a 500 body, or in-band then ``[DONE]``),
    with 30 they run to completion; the server exits with status 0 either way."""
    drain = shutdown_timeout > 0
    max_tokens = 300 if drain else 1500  # finishes within the drain; cannot finish before exit
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*VLLM, "serve", "demo/mllama-tiny", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "2048", "--max-num-seqs", "8", "--disable-log-stats"]
    cmd += ["--shutdown-timeout", str(shutdown_timeout), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
    )
    try:
        _wait_healthy(proc, url)
        common = {"max_tokens": max_tokens, "ignore_eos": True}
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        clients = [
            _Client(url, "/v1/chat/completions", {"messages": CHAT, **common, **opts}),
            _Client(url, "/v1/chat/completions", {"messages": CHAT, "n": 2, **common, **opts}),
            _Client(url, "/v1/completions", {"prompt": "once", **common, **opts}),
            _Client(url, "/v1/completions", {"prompt": ["a", "b"], **common, **opts}),
            _Client(url, "/v1/completions", {"prompt": "plain", **common}),  # not streamed
        ]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 30
        while _running(url) < 6:  # 6 engine requests (one per prompt) hold the batch
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.05)
        for c in clients:
            assert c.started.wait(30) and c.error is None, c.error
        assert all(c.json is None and "[DONE]" not in c.events for c in clients)  # in flight
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refused = False
        while not refused and time.monotonic() < sent + 5:
            try:  # the listener closes at once, while the requests are still draining
                httpx.get(f"{url}/health", timeout=2)
                time.sleep(0.05)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                refused = True  # refused, or accepted from the backlog and closed unanswered
        code = proc.wait(timeout=shutdown_timeout + 20)
        took = time.monotonic() - sent
        for c in clients:
            c.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read() if proc.stdout else ""
    assert code == 0 and refused, log
    assert "Server stopped (SIGTERM)" in log
    for c in clients:
        _check_outcome(c, drain, max_tokens)
    if not drain:
        assert took < 10, took  # aborted, not drained
