"""Chat messages -> prompt: parsing, templates (tokenizer's, --chat-template, per request),
chat_template_kwargs, roles, and request logging; in-process through ASGI (no socket)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai_server_utils import parse_server_args, png_data_url

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.entrypoints.chat_utils import (
    load_chat_template,
    parse_chat_messages,
    parse_conversation,
    render_chat_prompt,
)
from vllm.entrypoints.openai.api_server import build_app

INLINE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}[reply]{% endif %}"
)


def _call(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json=body)

    return asyncio.run(run())


def test_load_chat_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(INLINE)
    assert load_chat_template(str(path)) == INLINE
    assert load_chat_template(INLINE) == INLINE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a readable file"):
        load_chat_template("no/such/template.jinja")


def test_parse_conversation() -> None:
    parsed = parse_conversation(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "data:x"}},
                ],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert parsed.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}]
    assert parsed.messages[1]["content"] == "" and parsed.image_sources == ["data:x"]
    for bad in (
        [],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ):
        with pytest.raises(ValueError):
            parse_conversation(bad)


def test_render_with_kwargs_and_bos(engine: AsyncLLMEngine) -> None:
    tok = engine.get_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    text = render_chat_prompt(tok, msgs, chat_template_kwargs={"date_string": "1 Jan 2025"})
    assert "Today Date: 1 Jan 2025" in text and text.startswith("<|begin_of_text|>")
    prompt = parse_chat_messages(msgs, tok)
    assert prompt["prompt_token_ids"].count(256) == 1
    with pytest.raises(ValueError, match="incompatible with system messages"):
        parse_chat_messages(
            [
                {"role": "system", "content": "s"},
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": png_data_url()}}],
                },
            ],
            tok,
        )


def test_server_chat_template_override(engine: AsyncLLMEngine) -> None:
    app = build_app(
        parse_server_args(["--chat-template", INLINE, "--response-role", "bot"]), engine
    )
    tok = _call(app, "/tokenize", {"messages": [{"role": "user", "content": "q"}]}).json()
    text = engine.get_tokenizer().decode(tok["tokens"])
    assert text == "<|begin_of_text|>[user]q[reply]"
    r = _call(
        app,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "bot"
    assert r.json()["usage"]["prompt_tokens"] == tok["count"]
    # A per-request template is refused unless the server trusts them; then it wins.
    body = {"messages": [{"role": "user", "content": "q"}], "chat_template": "{{ bos_token }}X"}
    r = _call(app, "/tokenize", body)
    assert r.status_code == 400 and "--trust-request-chat-template" in r.text
    trusting = build_app(
        parse_server_args(["--chat-template", INLINE, "--trust-request-chat-template"]), engine
    )
    r = _call(trusting, "/tokenize", body)
    assert engine.get_tokenizer().decode(r.json()["tokens"]) == "<|begin_of_text|>X"


def test_role_without_generation_prompt(engine: AsyncLLMEngine) -> None:
    app = build_app(parse_server_args(), engine)
    r = _call(
        app,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 2,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_request_logging(engine: AsyncLLMEngine) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("vllm.entrypoints.openai.serving_engine")
    log.addHandler(handler)
    try:
        app = build_app(parse_server_args(["--enable-log-requests", "--max-log-len", "4"]), engine)
        r = _call(app, "/v1/completions", {"prompt": "abcdefgh", "max_tokens": 1})
        assert r.status_code == 200
    finally:
        log.removeHandler(handler)
    messages = [rec.getMessage() for rec in records if "Received request" in rec.getMessage()]
    assert len(messages) == 1 and "'abcd'" in messages[0] and "abcde" not in messages[0]


def test_disable_fastapi_docs(engine: AsyncLLMEngine) -> None:
    app = build_app(parse_server_args(["--disable-fastapi-docs"]), engine)

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [(await c.get(p)).status_code for p in ("/openapi.json", "/docs", "/health")]

    assert asyncio.run(run()) == [404, 404, 200]
