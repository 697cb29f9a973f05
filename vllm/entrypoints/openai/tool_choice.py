"""A chat request's ``tools`` and ``tool_choice``: what the template sees, what the output is
constrained to, and how the output becomes ``tool_calls`` (whole, or streamed as deltas).

* ``none``: the tools reach the chat template; the output is plain content.
* ``auto`` (the default when ``tools`` are given, as in the OpenAI API): needs
  ``--enable-auto-tool-choice`` and ``--tool-call-parser``; the output is free and the
  parser reads calls out of it (``tool_parsers.py``).
* ``required``: the grammar makes the output a JSON array of at least one
  ``{"name", "parameters"}`` object, each matching one tool's schema (one element when
  ``parallel_tool_calls`` is false).
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  that function's arguments, constrained by its ``parameters`` schema.

``finish_reason`` is ``tool_calls`` when ``auto`` or ``required`` produced calls (a named
function stops with ``stop``, as OpenAI's API does); ``length`` stays ``length``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.tool_parsers import (
    ToolCall,
    extract_tool_calls,
    parse_calls,
    parse_required,
    tool_call_id,
)
from vllm.guided_params import GuidedDecodingParams

MAX_TOOLS = 128


class ToolChoiceError(ValueError):
    """A ``tools`` / ``tool_choice`` combination this server cannot serve (a 400)."""


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise ToolChoiceError("tools must be a non-empty list of function tools.")
    if len(tools) > MAX_TOOLS:
        raise ToolChoiceError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed.")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolChoiceError(f"tools[{i}] must be a tool of type 'function'.")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f"tools[{i}].function must have a non-empty string 'name'.")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolChoiceError(f"tools[{i}].function.parameters must be a JSON schema object.")
        if fn["name"] in names:
            raise ToolChoiceError(f"tools: the function name {fn['name']!r} appears twice.")
        names.add(fn["name"])
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a ``required`` answer: an array of calls of the given tools."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do: ``choice`` is ``none``, ``auto``, ``required`` or
    ``named`` (``name`` then holds the function's name)."""

    choice: str = "none"
    tools: list[dict[str, Any]] | None = None
    name: str | None = None
    parallel: bool = True
    guided: GuidedDecodingParams | None = None

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"


def plan_tools(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    auto_enabled: bool,
    has_other_constraint: bool,
) -> ToolPlan:
    """Checks the request's tool fields against the server's flags (raises
    ``ToolChoiceError`` with a message for the client)."""
    parallel = parallel_tool_calls is not False
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ToolChoiceError("When using `tool_choice`, `tools` must be set.")
        return ToolPlan()
    tools = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if choice == "auto":
        if not auto_enabled:
            raise ToolChoiceError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (tools without tool_choice mean "auto"; send tool_choice "none", '
                '"required" or a named function instead).'
            )
        return ToolPlan("auto", tools, parallel=parallel)
    if has_other_constraint:
        raise ToolChoiceError(
            "tool_choice 'required' or a named function cannot be combined with "
            "response_format or guided decoding: both constrain the output."
        )
    if choice == "required":
        guided = GuidedDecodingParams(json=required_schema(tools, parallel))
        return ToolPlan("required", tools, parallel=parallel, guided=guided)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ToolChoiceError(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.'
            )
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise ToolChoiceError(f"Tool '{name}' has not been passed in `tools`.")
        guided = GuidedDecodingParams(json=_parameters(tool))
        return ToolPlan("named", tools, name=name, parallel=parallel, guided=guided)
    raise ToolChoiceError(
        f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function."
    )


def finish_reason(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    if called and reason == "stop" and plan.choice in ("auto", "required"):
        return "tool_calls"
    return reason


def complete_message(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content and calls."""
    if plan.choice == "named":
        assert plan.name is not None
        return None, [ToolCall(plan.name, text)]
    if plan.choice == "required":
        calls = parse_required(text)
        return (None if calls else text), calls
    if plan.choice == "auto":
        content, calls = extract_tool_calls(text)
        return content, (calls if plan.parallel else calls[:1])
    return text, []


@dataclass
class ToolCallStream:
    """One streamed choice's text -> content and ``tool_calls`` deltas. ``feed`` takes each
    new piece of text and returns ``(content, tool_call_deltas)`` to send now; ``finish``
    whatever is left once the choice has ended."""

    plan: ToolPlan
    text: str = ""
    sent_calls: int = 0
    sent_content: int = 0  # characters of ``text`` sent as content
    named_id: str = field(default_factory=tool_call_id)
    named_started: bool = False

    @property
    def called(self) -> bool:
        return self.sent_calls > 0

    def feed(self, delta: str) -> tuple[str | None, list[dict[str, Any]]]:
        self.text += delta
        choice = self.plan.choice
        if choice == "none":
            return self._content_from(len(self.text) - len(delta))
        if choice == "named":
            return None, self._named(delta)
        if choice == "required":
            return None, self._new_calls(parse_required(self.text))
        calls, _, is_tool = parse_calls(self.text)
        if not is_tool:
            return self._content_from(self.sent_content)
        return None, self._new_calls(calls)

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        choice = self.plan.choice
        if choice in ("none", "named"):
            return None, []
        if choice == "required":
            return (None, []) if self.sent_calls else self._content_from(self.sent_content)
        content, calls = extract_tool_calls(self.text)
        deltas = self._new_calls(calls)
        if not calls:
            return self._content_from(self.sent_content)[0], deltas
        if content is not None and self.sent_content == 0:
            self.sent_content = len(self.text)
            return content, deltas
        return None, deltas

    def _content_from(self, start: int) -> tuple[str | None, list[dict[str, Any]]]:
        piece = self.text[start:]
        self.sent_content = len(self.text)
        return (piece or None), []

    def _named(self, delta: str) -> list[dict[str, Any]]:
        if not self.named_started:
            self.named_started = True
            self.sent_calls = 1
            return [
                {
                    "index": 0,
                    "id": self.named_id,
                    "type": "function",
                    "function": {"name": self.plan.name, "arguments": delta},
                }
            ]
        return [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def _new_calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        if not self.plan.parallel:
            calls = calls[:1]
        new = calls[self.sent_calls :]
        deltas = [c.delta_json(self.sent_calls + i) for i, c in enumerate(new)]
        self.sent_calls = len(calls)
        return deltas
