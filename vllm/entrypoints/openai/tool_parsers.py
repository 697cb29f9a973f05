"""Reading tool calls out of generated text (``--tool-call-parser``), whole and streamed.

``llama3_json`` is the Llama 3 JSON tool-call format: the assistant answers with one or more
objects ``{"name": <function>, "parameters": {...}}`` (``arguments`` is taken for
``parameters``), separated by ``;``, optionally after the ``<|python_tag|>`` token. Text that
does not start with ``{`` is an ordinary answer. A complete response and a stream split
anywhere give the same calls: both use ``parse_calls``, which reads the complete calls from
the start of the text and says where the rest begins.

Under ``tool_choice: "required"`` the grammar makes the output a JSON array of such objects
(``parse_required``); under a named function it is the function's arguments alone.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("llama3_json",)
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = tool_call_id()

    def message_json(self) -> dict[str, Any]:
        """The call as a message's ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def delta_json(self, index: int) -> dict[str, Any]:
        """The call as one streamed ``tool_calls`` delta (the whole call at once)."""
        return {"index": index, **self.message_json()}


def _as_call(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("parameters", value.get("arguments", {}))
    if isinstance(args, str):  # arguments already serialised
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def parse_calls(text: str) -> tuple[list[ToolCall], int, bool]:
    """The complete Llama 3 JSON calls at the start of ``text``, the offset where the text
    after them begins, and whether ``text`` is (so far) a tool-call answer at all: it is when
    its first character other than whitespace (after an optional ``<|python_tag|>``) is
    ``{``. An object that is not a call, or a separator other than ``;``, ends the calls."""
    pos = _skip(text, 0, " \t\r\n")
    if text.startswith(PYTHON_TAG, pos):
        pos = _skip(text, pos + len(PYTHON_TAG), " \t\r\n")
    if pos >= len(text) or PYTHON_TAG.startswith(text[pos:]):
        return [], 0, True  # nothing yet that decides (a stream may hold part of the tag)
    if text[pos] != "{":
        return [], 0, False
    calls: list[ToolCall] = []
    end = 0
    while pos < len(text) and text[pos] == "{":
        try:
            value, after = _DECODER.raw_decode(text, pos)
        except ValueError:
            break  # incomplete (streaming) or not JSON
        call = _as_call(value)
        if call is None:
            break
        calls.append(call)
        end = after
        pos = _skip(text, after, " \t\r\n")
        if pos < len(text) and text[pos] == ";":
            pos = _skip(text, pos + 1, " \t\r\n")
        else:
            break
    return calls, end, True


def extract_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A complete ``llama3_json`` answer: its content (text that is not a call, or None)
    and its calls."""
    calls, end, is_tool = parse_calls(text)
    if not is_tool or not calls:
        return text, []
    rest = text[end:].strip().lstrip(";").strip()
    return (rest or None), calls


def parse_required(text: str) -> list[ToolCall]:
    """The complete calls of a ``tool_choice: "required"`` answer (a JSON array of
    ``{"name", "parameters"}`` objects), as far as the text goes."""
    pos = _skip(text, 0, " \t\r\n")
    if not text.startswith("[", pos):
        return []
    pos += 1
    calls: list[ToolCall] = []
    while True:
        pos = _skip(text, pos, " \t\r\n")
        if pos >= len(text) or text[pos] != "{":
            return calls
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return calls
        call = _as_call(value)
        if call is None:
            return calls
        calls.append(call)
        pos = _skip(text, pos, " \t\r\n")
        if pos < len(text) and text[pos] == ",":
            pos += 1
        else:
            return calls
