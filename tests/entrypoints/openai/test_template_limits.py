"""Chat templates on the server: a request's own template is refused unless the server trusts
them, and every template (the server's own too) renders under a budget that stops it from
inside: a 400 naming the limit, while other requests go on unchanged and /health answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from attack_utils import run_attack
from openai_server_utils import RunningServer, start_server

from vllm.engine.async_llm_engine import AsyncLLMEngine

HI = [{"role": "user", "content": "hi"}]
LOOP_FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_request_chat_template_needs_the_trust_flag(server: RunningServer) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"

    async def attack(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await c.post("/tokenize", json={"messages": HI, "chat_template": template}),
            await c.post(
                "/v1/chat/completions",
                json={"messages": HI, "max_tokens": 2, "chat_template": template},
            ),
        ]

    replies, _ = run_attack(server, attack)
    for r in replies:
        assert r.status_code == 400, r.text
        assert "--trust-request-chat-template is not set" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "template,message",
    [
        ("{% set x = 'ab' * 100000000 %}{{ bos_token }}{{ x|length }}", "tried to build"),
        ("{% for i in range(10**6) %}{% endfor %}{{ bos_token }}", "tried to build a range"),
    ],
    ids=["200 MB string", "range overflow"],
)
def test_the_servers_own_template_runs_under_the_budget(
    engine: AsyncLLMEngine, template: str, message: str
) -> None:
    srv = start_server(engine, ["--chat-template", template])
    try:

        async def attack(c: httpx.AsyncClient) -> list[httpx.Response]:
            body = {"messages": HI, "max_tokens": 2}
            return [await c.post("/v1/chat/completions", json=body),
                    await c.post("/tokenize", json={"messages": HI})]

        replies, _ = run_attack(srv, attack)
        for r in replies:
            assert r.status_code == 400, r.text
            assert message in r.json()["error"]["message"]
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def trusting(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    flags = ["--trust-request-chat-template", "--chat-template-timeout", "0.2",
             "--chat-template-max-steps", "100000000"]
    srv = start_server(engine, flags)
    yield srv
    srv.stop()


def test_trusted_templates_stop_at_the_deadline(trusting: RunningServer) -> None:
    """Six looping templates at once (the default thread pool's size on two cores) end in a
    400 each: the renders stop themselves, so chats are not held up behind them."""

    async def attack(c: httpx.AsyncClient) -> list[httpx.Response]:
        body = {"messages": HI, "chat_template": LOOP_FOREVER}
        return list(await asyncio.gather(*(c.post("/tokenize", json=body) for _ in range(6))))

    replies, _ = run_attack(trusting, attack)
    for r in replies:
        assert r.status_code == 400, r.text
        assert "ran longer than 0.2 s (--chat-template-timeout)" in r.json()["error"]["message"]
    ok = httpx.post(f"{trusting.url}/tokenize", timeout=30, json={
        "messages": HI, "chat_template": "{{ bos_token }}{{ messages[0].content }}"})
    assert ok.status_code == 200 and ok.json()["count"] >= 2


def test_template_errors_are_400_not_500(trusting: RunningServer) -> None:
    for template, message in [
        ("{{ raise_exception('no tools here') }}", "no tools here"),
        ("{{ 'a' + 1 }}", "could not be rendered"),
        ("{% for %}", "Expected an expression"),
    ]:
        r = httpx.post(f"{trusting.url}/tokenize", timeout=30,
                       json={"messages": HI, "chat_template": template})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
