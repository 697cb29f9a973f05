"""Request field types as JSON Schema states them, and the marker of per-app bounds.

pydantic's lax mode would take ``true`` for 1 and ``"5"`` for 5; these types take JSON's
numbers only (an integral float such as 2.0 is an integer, as in JSON Schema), so that what the
published schema refuses the server refuses too.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictBool

# Marks a schema the published OpenAPI document bounds with this app's numbers (openapi.py):
# a token id (the vocabulary), a token list (the context length), ...
X_BOUND = "x-vllm-bound"


def _json_type(kind: str) -> BeforeValidator:
    """Accepts a JSON number only: a boolean or a numeric string is not one (pydantic's lax
    mode would take ``true`` as 1 and ``"5"`` as 5, which the schema does not allow)."""

    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"Input should be a valid {kind}")
        return value

    return BeforeValidator(check)


Int = Annotated[int, _json_type("integer")]


def bounded_int(**bounds: int) -> Any:
    """``Int`` within ``ge``/``le`` bounds (given before the type check, so that the schema
    states them as ``minimum``/``maximum``)."""
    return Annotated[int, Field(**bounds), _json_type("integer")]


Float = Annotated[float, _json_type("number")]
Bool = StrictBool
TokenId = Annotated[int, _json_type("integer"), Field(json_schema_extra={X_BOUND: "token_id"})]
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra={X_BOUND: "tokens"})]
# A prompt text: longer than max_model_len times the longest token, it cannot fit.
PromptText = Annotated[str, Field(json_schema_extra={X_BOUND: "prompt_chars"})]


def is_token_ids(value: Any) -> bool:
    """A non-empty list of integers (booleans are not token ids)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
