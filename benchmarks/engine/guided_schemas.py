"""The structured-output suite: JSON schemas, regular expressions and choices whose outputs
have bounded length, each with a check that does not use the grammar engine (``jsonschema``,
``re``, list membership). The engine tests run it on the random demo model, where only the
constraint can make the output valid; ``python -m benchmarks.engine guided`` decodes under
``NESTED`` (the suite's nested object) on the GPU."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "active": {"type": "boolean"},
            },
            "required": ["name", "active"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["id", "owner", "items"],
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": NESTED,
    "bounded_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"enum": [1, 2, 3]},
            "mode": {"const": "fast"},
        },
        "required": ["color", "size", "mode"],
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 100},
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
            },
        ]
    },
    "formats": {
        "type": "object",
        "properties": {
            "uuid": {"type": "string", "format": "uuid"},
            "when": {
                "type": "string",
                "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])$",
            },
        },
        "required": ["uuid", "when"],
    },
    "ranges": {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -10, "maximum": 10},
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
            "flag": {"type": "boolean"},
        },
        "required": ["score", "level", "flag"],
    },
}

REGEXES: dict[str, str] = {
    "email": r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)",
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "answer": r"(yes|no)(, because [a-z]{1,10})?",
}

CHOICES: dict[str, list[str]] = {
    "weather": ["sunny", "cloudy", "rainy"],
    "shared_prefix": ["alpha beta", "alpha gamma", "delta"],
}


@dataclass(frozen=True)
class Case:
    """One constraint of the suite: its kind (a ``GuidedDecodingParams`` field) and spec."""

    name: str
    kind: str
    spec: Any

    def valid(self, text: str) -> bool:
        """Whether a complete output satisfies the constraint (checked without xgrammar)."""
        if self.kind == "regex":
            return re.fullmatch(self.spec, text) is not None
        if self.kind == "choice":
            return text in self.spec
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError:
            return False
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        return jsonschema.Draft202012Validator(self.spec, format_checker=checker).is_valid(value)


CASES: list[Case] = (
    [Case(n, "json", s) for n, s in SCHEMAS.items()]
    + [Case(n, "regex", r) for n, r in REGEXES.items()]
    + [Case(n, "choice", c) for n, c in CHOICES.items()]
)
