"""The llama3_json tool-call parser and the tool_choice plans against hand-written answers:
whole answers, and the same answers streamed in pieces split at every position (the deltas
must add up to the whole answer's calls and content)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from vllm.entrypoints.openai.tool_choice import (
    ToolCallStream,
    ToolChoiceError,
    ToolPlan,
    complete_message,
    finish_reason,
    plan_tools,
    required_schema,
)
from vllm.entrypoints.openai.tool_parsers import extract_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
AUTO = ToolPlan("auto", TOOLS)

# (answer, expected content, expected calls as (name, arguments object))
CASES: list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    (
        '<|python_tag|>{"name": "add", "arguments": {"a": 3, "b": 4}}',
        None,
        [("add", {"a": 3, "b": 4})],
    ),
    (
        ' {"name": "now", "parameters": {}}; {"name": "add", "parameters": {"a": 5, "b": 6}}',
        None,
        [("now", {}), ("add", {"a": 5, "b": 6})],
    ),
    ('{"name": "now", "parameters": {"tz": "é"}} and then', "and then", [("now", {"tz": "é"})]),
    ("The answer is 3.", "The answer is 3.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "add", "parameters": {"a": 1,', '{"name": "add", "parameters": {"a": 1,', []),
]


def _calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("text", "content", "expected"), CASES)
def test_whole_answers(text: str, content: str | None, expected: list) -> None:
    got_content, calls = extract_tool_calls(text)
    assert got_content == content and _calls(calls) == expected
    got_content, calls = complete_message(AUTO, text)
    assert got_content == content and _calls(calls) == expected
    assert finish_reason(AUTO, "stop", bool(calls)) == ("tool_calls" if expected else "stop")


def _stream(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list[str]]:
    s = ToolCallStream(plan)
    content, calls, ids = "", {}, []
    for i, piece in enumerate(pieces):
        out = [s.feed(piece)]
        if i == len(pieces) - 1:
            out.append(s.finish())
        for text, deltas in out:
            content += text or ""
            for d in deltas:
                call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                if "id" in d:
                    ids.append(d["id"])
                call["name"] = d["function"].get("name") or call["name"]
                call["arguments"] += d["function"].get("arguments", "")
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], ids


@pytest.mark.parametrize(("text", "content", "expected"), CASES)
def test_streamed_answers_split_anywhere(text: str, content: str | None, expected: list) -> None:
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 7)):
            pieces = [text[:cut], text[cut:cut2], text[cut2:]]
            got_content, calls, ids = _stream(AUTO, pieces)
            assert (got_content or None) == content, (cut, cut2)
            assert calls == expected, (cut, cut2)
            assert len(set(ids)) == len(ids) == len(expected)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = CASES[2][0]
    plan = ToolPlan("auto", TOOLS, parallel=False)
    assert _calls(complete_message(plan, text)[1]) == [("now", {})]
    assert _stream(plan, [text[:40], text[40:]])[1] == [("now", {})]


def test_required_and_named_answers() -> None:
    plan = plan_tools(TOOLS, "required", None, False, False)
    assert plan.guided is not None and plan.guided.json == required_schema(TOOLS, True)
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]'
    jsonschema.validate(json.loads(text), plan.guided.json)
    with pytest.raises(jsonschema.ValidationError):  # not one of the tools' calls
        jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], plan.guided.json)
    assert _calls(complete_message(plan, text)[1]) == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert _stream(plan, [text[:30], text[30:60], text[60:]])[1] == [
        ("add", {"a": 1, "b": 2}),
        ("now", {}),
    ]
    assert finish_reason(plan, "stop", True) == "tool_calls"
    assert finish_reason(plan, "length", True) == "length"
    single = plan_tools(TOOLS, "required", False, False, False)
    assert single.guided is not None and single.guided.json["maxItems"] == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None, False, False)
    assert named.guided is not None and named.guided.json == TOOLS[0]["function"]["parameters"]
    args = '{"a": 7, "b": 8}'
    assert _calls(complete_message(named, args)[1]) == [("add", {"a": 7, "b": 8})]
    assert _stream(named, ['{"a": 7', ", ", '"b": 8}'])[1] == [("add", {"a": 7, "b": 8})]
    assert finish_reason(named, "stop", True) == "stop"


@pytest.mark.parametrize(
    ("tools", "choice", "auto", "other", "message"),
    [
        (TOOLS, None, False, False, "--enable-auto-tool-choice"),
        (TOOLS, "auto", False, False, "--enable-auto-tool-choice"),
        (None, "auto", True, False, "`tools` must be set"),
        (TOOLS, {"type": "function", "function": {"name": "sub"}}, True, False, "'sub'"),
        (TOOLS, "sometimes", True, False, "is not one of"),
        (TOOLS, "required", True, True, "cannot be combined"),
        ([{"type": "retrieval"}], "none", True, False, "of type 'function'"),
        (TOOLS + TOOLS[:1], "none", True, False, "appears twice"),
        (TOOLS, {"type": "function"}, True, False, "tool_choice must be"),
    ],
)
def test_plan_errors(tools: Any, choice: Any, auto: bool, other: bool, message: str) -> None:
    with pytest.raises(ToolChoiceError, match=message):
        plan_tools(tools, choice, None, auto, other)


def test_plans_without_errors() -> None:
    assert plan_tools(None, None, None, False, False).choice == "none"
    assert plan_tools(TOOLS, None, None, True, False).choice == "auto"
    assert plan_tools(TOOLS, "none", None, False, False).guided is None
