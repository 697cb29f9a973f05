"""JSON schemas before xgrammar compiles them: what it would not enforce is refused, and string
length limits are restated in a form it enforces exactly.

xgrammar (0.2) accepts some keywords without enforcing them: output that follows the grammar
could still fail the schema. Those are refused with the keyword and its path, so a client
never gets "valid" output that does not validate: ``uniqueItems``, ``contains`` (and
``minContains`` / ``maxContains``), ``not``, ``if`` / ``then`` / ``else``, ``allOf`` with more
than one schema, ``dependentRequired``, ``dependentSchemas`` and ``dependencies``. A string with
``minLength`` / ``maxLength`` and no ``pattern`` or ``format`` gets an equivalent ``pattern``
of unescaped characters (xgrammar's own length rule lets control characters through, which
JSON does not allow). Nesting is bounded (``MAX_SCHEMA_DEPTH``).
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.guided_params import GuidedDecodingError

MAX_SCHEMA_DEPTH = 64
_UNENFORCED = (
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
# A JSON string character that needs no escape: not a control character, quote or backslash.
_PLAIN_CHAR = '[^\\x00-\\x1f"\\\\]'


def _children(node: dict[str, Any], path: str) -> list[tuple[Any, str]]:
    """The sub-schemas of ``node`` (and lists of them) with their paths."""
    out: list[tuple[Any, str]] = []
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(
            value, dict
        ):
            out += [(v, f"{path}.{key}.{k}") for k, v in value.items()]
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            out += [(v, f"{path}.{key}[{i}]") for i, v in enumerate(value)]
        elif key in ("items", "additionalProperties", "propertyNames") and isinstance(
            value, (dict, list)
        ):
            out.append((value, f"{path}.{key}"))
    return out


def _check_node(node: dict[str, Any], path: str) -> None:
    for key in _UNENFORCED:
        if key in node:
            raise GuidedDecodingError(
                f"guided_json: the schema keyword '{key}' (at {path}) is not supported by the "
                "xgrammar backend."
            )
    if node.get("uniqueItems") is True:
        raise GuidedDecodingError(
            f"guided_json: the schema keyword 'uniqueItems' (at {path}) is not supported by "
            "the xgrammar backend."
        )
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise GuidedDecodingError(
            f"guided_json: 'allOf' with more than one schema (at {path}) is not supported by "
            "the xgrammar backend."
        )


def _restate_length(node: dict[str, Any]) -> None:
    """``minLength`` / ``maxLength`` of a plain string as an equivalent pattern."""
    if node.get("type") != "string" or "pattern" in node or "format" in node:
        return
    low, high = node.get("minLength"), node.get("maxLength")
    if low is None and high is None:
        return
    if not all(v is None or (isinstance(v, int) and v >= 0) for v in (low, high)):
        return  # left for xgrammar to refuse
    lo = low or 0
    hi = "" if high is None else str(high)
    node["pattern"] = f"^{_PLAIN_CHAR}{{{lo},{hi}}}$"
    node.pop("minLength", None)
    node.pop("maxLength", None)


def _walk(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """Every sub-schema object, checked on the way; iterative (the nesting depth is the
    client's choice), refusing nesting deeper than ``MAX_SCHEMA_DEPTH``."""
    nodes: list[dict[str, Any]] = []
    stack: list[tuple[Any, str, int]] = [(schema, "$", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GuidedDecodingError(
                f"guided_json: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels."
            )
        if isinstance(node, list):
            stack += [(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node)]
        elif isinstance(node, dict):
            _check_node(node, path)
            nodes.append(node)
            stack += [(child, where, depth + 1) for child, where in _children(node, path)]
    return nodes


def prepare_schema(schema: Any) -> Any:
    """A copy of ``schema`` ready for xgrammar; raises ``GuidedDecodingError`` for what it
    would not enforce or for nesting deeper than ``MAX_SCHEMA_DEPTH``."""
    if not isinstance(schema, dict):
        return schema
    _walk(schema)  # before copying: deep nesting is refused, not recursed into
    schema = copy.deepcopy(schema)
    for node in _walk(schema):
        _restate_length(node)
    return schema
