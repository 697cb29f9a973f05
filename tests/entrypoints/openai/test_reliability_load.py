"""Reliability under load: hundreds of mixed concurrent requests in rounds (streamed and not,
chat with random images and text, completions, n > 1, clients that hang up mid-stream), then a
KV cache too small for the load. Nothing is lost: every request that was not abandoned gets
exactly ``max_tokens`` tokens per choice, greedy requests match their single-request outputs,
every KV page comes back, and the process does not grow from round to round.

Token ids travel through ``logprobs`` as decoded text. The tiny checkpoint's byte tokenizer
decodes ids 128..255 (lone UTF-8 bytes) all to U+FFFD, so greedy requests restrict sampling to
the other ids (``allowed_token_ids``), whose text maps back to one id each.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.compare import TokensAndLogprobs, check_logprobs_close
from openai_server_utils import RunningServer, parse_server_args, start_server, wait_until_idle

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine

MAX_NUM_SEQS = 32
CONCURRENCY = 32
ROUNDS = 3
REQUESTS_PER_ROUND = 100  # 300 in all
NUM_GREEDY_TEMPLATES = 12
TOP_LOGPROBS = 3
ALLOWED_IDS = [*range(128), *range(256, 512)]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class Job:
    """One request: its body, what it must produce, and whether the client hangs up early."""

    path: str
    body: dict[str, Any]
    choices: int  # n x prompts
    ref: int | None = None  # index of the greedy template (its single-request output)
    abort_after: int | None = None  # close the stream after this many events


@dataclass
class Result:
    """Per choice index: (token texts, top logprobs per position); the finish reasons; usage."""

    tokens: dict[int, list[tuple[str, dict[str, float]]]]
    finish: dict[int, str | None]
    completion_tokens: int | None


def engine_with(*flags: str) -> AsyncLLMEngine:
    """An engine of its own: the test servers' engine flags plus ``flags``."""
    return AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(parse_server_args(list(flags))))


def random_png_url(rng: random.Random) -> str:
    from PIL import Image

    w, h = rng.randint(8, 48), rng.randint(8, 48)
    img = Image.frombytes("RGB", (w, h), rng.randbytes(w * h * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_messages(text: str, image: str | None) -> list[dict[str, Any]]:
    if image is None:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def job_body(path: str, prompt: Any, max_tokens: int, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, **kw}
    if path == CHAT:
        body.update(messages=prompt, logprobs=True, top_logprobs=TOP_LOGPROBS)
    else:
        body.update(prompt=prompt, logprobs=TOP_LOGPROBS)
    return body


def greedy_templates(seed: int = 0) -> list[Job]:
    """Greedy requests (chat with and without an image, completions from text and ids)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(NUM_GREEDY_TEMPLATES):
        kind, max_tokens = i % 4, rng.randint(4, 12)
        extra = {"temperature": 0.0, "allowed_token_ids": ALLOWED_IDS}
        if kind == 0:
            prompt: Any = chat_messages(f"Tell me about {i} things.", None)
        elif kind == 1:
            prompt = chat_messages(f"Describe picture {i}.", random_png_url(rng))
        elif kind == 2:
            prompt = f"Once upon a time, number {i},"
        else:
            prompt = [rng.randrange(256) for _ in range(rng.randint(3, 20))]
        path = CHAT if kind < 2 else COMPLETIONS
        jobs.append(Job(path, job_body(path, prompt, max_tokens, **extra), 1, ref=i))
    return jobs


def sampled_job(rng: random.Random, i: int) -> Job:
    """A sampled request: chat (n up to 3, maybe with an image) or completions of 2 prompts."""
    max_tokens, n = rng.randint(4, 12), rng.randint(1, 3)
    extra = {"temperature": 1.0, "n": n, "seed": rng.randrange(1 << 30)}
    if rng.random() < 0.6:
        image = random_png_url(rng) if rng.random() < 0.5 else None
        return Job(CHAT, job_body(CHAT, chat_messages(f"req {i}", image), max_tokens, **extra), n)
    prompts = [f"prompt {i} a", f"prompt {i} b"]
    return Job(COMPLETIONS, job_body(COMPLETIONS, prompts, max_tokens, **extra), 2 * n)


def round_jobs(templates: list[Job], seed: int, count: int, aborts: bool = True) -> list[Job]:
    """A shuffled mix: greedy templates again, sampled requests, streamed or not, aborts."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        if i % 3 == 0:
            t = templates[(i // 3) % len(templates)]
            job = Job(t.path, dict(t.body), t.choices, ref=t.ref)
        else:
            job = sampled_job(rng, i)
        if rng.random() < 0.5:
            job.body.update(stream=True, stream_options={"include_usage": True})
            if aborts and job.ref is None and rng.random() < 0.3:
                job.body["max_tokens"] = 12
                job.abort_after = rng.randint(1, 3)
        jobs.append(job)
    rng.shuffle(jobs)
    return jobs


def _positions(logprobs: dict[str, Any] | None) -> list[tuple[str, dict[str, float]]]:
    """(token text, {text: logprob} of the top alternatives) per position, chat or legacy."""
    if logprobs is None:
        return []
    if "content" in logprobs:
        return [
            (
                e["token"],
                {e["token"]: e["logprob"], **{t["token"]: t["logprob"] for t in e["top_logprobs"]}},
            )
            for e in logprobs["content"] or []
        ]
    return list(zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True))


async def run_job(client: httpx.AsyncClient, job: Job) -> Result | None:
    """Sends one job; ``None`` when the client hung up on purpose."""
    res = Result({}, {}, None)
    if not job.body.get("stream"):
        r = await client.post(job.path, json=job.body)
        assert r.status_code == 200, r.text
        data = r.json()
        for c in data["choices"]:
            res.tokens[c["index"]] = _positions(c["logprobs"])
            res.finish[c["index"]] = c["finish_reason"]
        res.completion_tokens = data["usage"]["completion_tokens"]
        return res
    events = 0
    async with client.stream("POST", job.path, json=job.body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            events += 1
            if job.abort_after is not None and events >= job.abort_after:
                return None
            for c in chunk["choices"]:
                res.tokens.setdefault(c["index"], []).extend(_positions(c.get("logprobs")))
                if c.get("finish_reason") is not None:
                    res.finish[c["index"]] = c["finish_reason"]
            if chunk.get("usage"):
                res.completion_tokens = chunk["usage"]["completion_tokens"]
    return res


async def run_jobs(server: RunningServer, jobs: list[Job]) -> tuple[list[Result | None], int]:
    """All jobs with ``CONCURRENCY`` in flight; returns the results and the largest number of
    requests the engine ran at once (sampled)."""
    gate = asyncio.Semaphore(CONCURRENCY)
    in_flight, peak = 0, 0
    limits = httpx.Limits(max_connections=2 * CONCURRENCY)
    scheduler = server.engine.engine.scheduler
    engine_peak = 0

    async def watch() -> None:
        nonlocal engine_peak
        while True:
            engine_peak = max(engine_peak, len(scheduler.running))
            await asyncio.sleep(0.005)

    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

        async def one(job: Job) -> Result | None:
            nonlocal in_flight, peak
            async with gate:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await run_job(client, job)
                finally:
                    in_flight -= 1

        watcher = asyncio.ensure_future(watch())
        try:
            results = await asyncio.gather(*(one(j) for j in jobs))
        finally:
            watcher.cancel()
    assert peak == CONCURRENCY  # the client really kept that many requests open
    return list(results), engine_peak


def as_ids(positions: list[tuple[str, dict[str, float]]], ids: dict[str, int]) -> TokensAndLogprobs:
    return [ids[t] for t, _ in positions], [
        {ids[t]: v for t, v in top.items()} for _, top in positions
    ]


def check_results(
    jobs: list[Job],
    results: list[Result | None],
    refs: list[TokensAndLogprobs],
    ids: dict[str, int],
) -> int:
    """Token counts, finish reasons and usage of every finished job; greedy ones against their
    single-request outputs. Returns the number of jobs checked."""
    checked = 0
    for job, res in zip(jobs, results, strict=True):
        if res is None:
            assert job.abort_after is not None
            continue
        checked += 1
        want = job.body["max_tokens"]
        assert sorted(res.tokens) == list(range(job.choices)), (job.body, res.tokens.keys())
        assert all(len(res.tokens[i]) == want for i in res.tokens), job.body
        assert set(res.finish.values()) == {"length"} and len(res.finish) == job.choices
        assert res.completion_tokens == want * job.choices, (res.completion_tokens, job.body)
        if job.ref is not None:
            check_logprobs_close([refs[job.ref]], [as_ids(res.tokens[0], ids)], "alone", "loaded")
    return checked


def rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the resident set size")


@pytest.fixture(scope="module")
def load_server() -> Iterator[RunningServer]:
    engine = engine_with("--max-num-seqs", str(MAX_NUM_SEQS))
    srv = start_server(engine)
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def token_ids(load_server: RunningServer) -> dict[str, int]:
    tok = load_server.engine.get_tokenizer()
    table = {tok.decode([i]): i for i in ALLOWED_IDS}
    assert len(table) == len(ALLOWED_IDS)  # the allowed ids decode to distinct texts
    return table


@pytest.fixture(scope="module")
def references(load_server: RunningServer, token_ids: dict[str, int]) -> list[TokensAndLogprobs]:
    """Each greedy template sent alone, one at a time."""
    results = asyncio.run(run_jobs_one_by_one(load_server, greedy_templates()))
    refs = []
    for job, res in zip(greedy_templates(), results, strict=True):
        assert res is not None and len(res.tokens[0]) == job.body["max_tokens"]
        refs.append(as_ids(res.tokens[0], token_ids))
    return refs


async def run_jobs_one_by_one(server: RunningServer, jobs: list[Job]) -> list[Result | None]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        return [await run_job(client, j) for j in jobs]


def test_rounds_of_mixed_load(
    load_server: RunningServer, references: list[TokensAndLogprobs], token_ids: dict[str, int]
) -> None:
    engine = load_server.engine
    templates = greedy_templates()
    rss: list[int] = []
    total = aborted = 0
    for r in range(ROUNDS):
        jobs = round_jobs(templates, seed=100 + r, count=REQUESTS_PER_ROUND)
        start = time.monotonic()
        results, peak = asyncio.run(run_jobs(load_server, jobs))
        elapsed = time.monotonic() - start
        assert peak >= MAX_NUM_SEQS // 2, peak  # the engine batched many requests at once
        checked = check_results(jobs, results, references, token_ids)
        total += len(jobs)
        aborted += len(jobs) - checked
        wait_until_idle(engine, timeout=20)  # every page free, pool integrity checked
        assert engine.engine.block_manager.pool.usage() == 0.0
        gc.collect()
        rss.append(rss_bytes())
        print(
            f"round {r}: {len(jobs)} requests in {elapsed:.1f} s, up to {peak} running at "
            f"once, rss {rss[-1] >> 20} MiB"
        )
    assert total >= 200 and aborted > 0
    assert rss[-1] <= rss[0] * 1.05, f"RSS grew from {rss[0] >> 20} to {rss[-1] >> 20} MiB"


PRESSURE_PAGES = 48


@pytest.fixture(scope="module")
def pressured_server() -> Iterator[RunningServer]:
    """The same engine with a KV cache far too small for 32 concurrent requests."""
    engine = engine_with(
        "--max-num-seqs", str(MAX_NUM_SEQS), "--num-gpu-blocks-override", str(PRESSURE_PAGES)
    )
    srv = start_server(engine)
    yield srv
    srv.stop()
    engine.shutdown()


def test_kv_pressure_preempts_and_loses_nothing(
    pressured_server: RunningServer,
    references: list[TokensAndLogprobs],
    token_ids: dict[str, int],
) -> None:
    engine = pressured_server.engine
    jobs = round_jobs(greedy_templates(), seed=7, count=64, aborts=False)
    results, _ = asyncio.run(run_jobs(pressured_server, jobs))
    print("preemptions", engine.engine.scheduler.num_preemptions)
    assert engine.engine.scheduler.num_preemptions > 0
    # Every request completes, greedy ones as they did alone on the roomy engine.
    assert check_results(jobs, results, references, token_ids) == len(jobs)
    wait_until_idle(engine, timeout=20)
