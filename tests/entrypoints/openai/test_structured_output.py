"""Structured output and tool calls through the OpenAI server, on the random demo model (only
the constraint can make its output valid): response_format, the guided_* and
structured_outputs fields, bad constraints as 400s, tool_choice required / named / auto
(complete and streamed), and the OpenAI SDK's ``chat.completions.parse`` with a pydantic
model and with tools."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai_server_utils import RunningServer, parse_server_args, start_server, wait_until_idle

from benchmarks.engine.guided_schemas import NESTED
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm_engine import AsyncLLMEngine

# Compact JSON: the random model would fill its budget with the whitespace JSON allows
# (the engine tests cover both forms).
TOOL_FLAGS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "llama3_json",
    "--guided-decoding-disable-any-whitespace",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    args = parse_server_args(["--max-model-len", "2048", *TOOL_FLAGS])
    eng = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: AsyncLLMEngine) -> Iterator[RunningServer]:
    srv = start_server(engine, ["--max-model-len", "2048", *TOOL_FLAGS])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    body = {"model": "demo/mllama-tiny", **body}
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)


def _valid_call(call: dict[str, Any]) -> bool:
    fn = call["function"]
    return fn["name"] in SCHEMAS and jsonschema.Draft202012Validator(SCHEMAS[fn["name"]]).is_valid(
        json.loads(fn["arguments"])
    )


def test_response_format_json_schema_and_object(client: openai.OpenAI) -> None:
    checker = jsonschema.Draft202012Validator(NESTED)
    stopped = 0
    for seed in range(3):
        r = client.chat.completions.create(
            model="demo/mllama-tiny",
            messages=MESSAGES,
            max_tokens=400,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "order", "schema": NESTED, "strict": True},
            },
        )
        c = r.choices[0]
        if c.finish_reason == "stop":
            stopped += 1
            assert checker.is_valid(json.loads(c.message.content)), c.message.content
    assert stopped >= 2
    r = client.chat.completions.create(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        max_tokens=300,
        seed=1,
        response_format={"type": "json_object"},
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.lstrip().startswith("{")


def test_guided_fields_on_both_endpoints(client: openai.OpenAI, server: RunningServer) -> None:
    r = client.chat.completions.create(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        max_tokens=40,
        extra_body={"guided_regex": r"[a-z]{2,5}-[0-9]{3}"},
    )
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", r.choices[0].message.content)
    r = client.completions.create(
        model="demo/mllama-tiny",
        prompt="Pick one:",
        max_tokens=20,
        n=2,
        seed=4,
        temperature=1.0,
        extra_body={"guided_choice": ["north", "south", "east"]},
    )
    assert all(c.text in ("north", "south", "east") for c in r.choices)
    r = client.completions.create(
        model="demo/mllama-tiny",
        prompt="A number:",
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": 'root ::= "n=" [1-9] [0-9]?'}},
    )
    assert re.fullmatch(r"n=[1-9][0-9]?", r.choices[0].text)
    # Streamed: the deltas add up to a valid output.
    stream = client.chat.completions.create(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        max_tokens=200,
        stream=True,
        extra_body={"guided_json": SCHEMAS["get_weather"], "guided_decoding_backend": "auto"},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["get_weather"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"guided_regex": "(ab"}, "Invalid guided_regex constraint"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "'uniqueItems'"),
        ({"guided_grammar": "root ::= undefined"}, 'Rule "undefined" is not defined'),
        ({"response_format": {"type": "yaml"}}, "response_format type 'yaml'"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "Only one kind of structured output",
        ),
        ({"guided_whitespace_pattern": " +", "guided_json": {}}, "guided_whitespace_pattern"),
        ({"structured_outputs": {"jsn": {}}}, "unknown field"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "'outlines'"),
        ({"guided_decoding_backend": "xgrammar:fast", "guided_regex": "a"}, "option 'fast'"),
        ({"guided_json": {"enum": ["x" * 70000]}}, "more than the limit of 65536"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "Tool 'x' has not been passed",
        ),
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
        ({"tools": [{"type": "function", "function": {}}]}, "non-empty string 'name'"),
    ],
)
def test_bad_constraints_are_400s(server: RunningServer, body: dict, message: str) -> None:
    r = _post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    r = _post(
        server, "chat/completions", {"messages": MESSAGES, "max_tokens": 5, "stream": True, **body}
    )
    assert r.status_code == 400  # before the stream's header
    wait_until_idle(server.engine)


def test_length_is_a_grammar_prefix(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        max_tokens=6,
        extra_body={"guided_regex": r"[a-z]{20,30}"},
    )
    c = r.choices[0]
    assert c.finish_reason == "length" and re.fullmatch(r"[a-z]{6}", c.message.content)


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    ok = 0
    for seed in range(3):  # one call each: the array is bounded, so the answer ends
        r = client.chat.completions.create(
            model="demo/mllama-tiny",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=400,
            temperature=1.0,
            seed=seed,
        )
        c = r.choices[0]
        if c.finish_reason == "tool_calls":
            ok += 1
            assert c.message.content is None and len(c.message.tool_calls) == 1
            assert _valid_call(c.message.tool_calls[0].model_dump())
    assert ok >= 2
    # Parallel calls: the random model keeps adding calls until max_tokens, and each
    # complete one is a valid call of one of the tools.
    r = client.chat.completions.create(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=150,
        seed=7,
        temperature=1.0,
    )
    c = r.choices[0]
    assert c.finish_reason in ("length", "tool_calls") and len(c.message.tool_calls) >= 1
    assert all(_valid_call(t.model_dump()) for t in c.message.tool_calls)
    assert len({t.id for t in c.message.tool_calls}) == len(c.message.tool_calls)
    r = client.chat.completions.create(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=100,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1
    assert c.message.tool_calls[0].function.name == "get_time"
    assert _valid_call(c.message.tool_calls[0].model_dump())


def _streamed_calls(stream: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for ch in stream:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "function": {"arguments": ""}})
            if d.function.name:
                call["function"]["name"] = d.function.name
            call["function"]["arguments"] += d.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_match_the_whole_answer(client: openai.OpenAI, choice: Any) -> None:
    kw = dict(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=400,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == whole.finish_reason and content == (whole.message.content or "")
    expected = [
        {"name": t.function.name, "arguments": t.function.arguments}
        for t in whole.message.tool_calls
    ]
    assert [c["function"] for c in calls] == expected and expected
    assert all(c["id"] for c in calls)


def test_auto_and_none(client: openai.OpenAI, server: RunningServer) -> None:
    """The random model does not write tool calls on its own: auto answers with content
    (the parser is tested against written calls in test_tool_parsers.py); without
    --enable-auto-tool-choice, tools without tool_choice are a 400."""
    r = client.chat.completions.create(
        model="demo/mllama-tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0
    )
    plain = client.chat.completions.create(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert plain.choices[0].message.tool_calls == []
    other = start_server(server.engine, ["--max-model-len", "2048"])
    try:
        r = _post(other, "chat/completions", {"messages": MESSAGES, "tools": TOOLS})
        assert r.status_code == 400
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = _post(
            other,
            "chat/completions",
            {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3},
        )
        assert r.status_code == 200
    finally:
        other.stop()


class Item(pydantic.BaseModel):
    sku: str = pydantic.Field(pattern="^[A-Z]{2}[0-9]$")
    qty: int = pydantic.Field(ge=1, le=9)


class Order(pydantic.BaseModel):
    id: int = pydantic.Field(ge=0, le=999)
    rush: bool
    items: list[Item] = pydantic.Field(min_length=1, max_length=2)


def test_sdk_parse_with_pydantic_model_and_tools(client: openai.OpenAI) -> None:
    parsed = 0
    for seed in range(3):
        try:
            r = client.chat.completions.parse(
                model="demo/mllama-tiny",
                messages=MESSAGES,
                response_format=Order,
                max_tokens=400,
                seed=seed,
                temperature=1.0,
            )
        except openai.LengthFinishReasonError:
            continue
        order = r.choices[0].message.parsed
        assert isinstance(order, Order) and 1 <= len(order.items) <= 2
        parsed += 1
    assert parsed >= 2
    tool = openai.pydantic_function_tool(Item, name="add_item")
    r = client.chat.completions.parse(
        model="demo/mllama-tiny",
        messages=MESSAGES,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "add_item"}},
        max_tokens=100,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "add_item" and isinstance(call.function.parsed_arguments, Item)
