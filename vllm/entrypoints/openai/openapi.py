"""The published OpenAPI schema (``/openapi.json``), made to agree with what the server does.

FastAPI derives the request and response bodies from the pydantic models; this module adds
what the models alone do not say: the error answers of each route (vLLM's error body, with a
400 where FastAPI would document a 422), the bounds the server enforces on single fields (the
sampling ranges of ``SamplingParams``, unsupported options), the bounds that depend on this
app's model and flags (vocabulary, context length, ``--max-logprobs``, ``--max-num-seqs``,
whether request chat templates are trusted) and the shape of chat messages. Constraints that
tie several fields together (the prompt's length plus ``max_tokens``, ``n > 1`` with greedy
sampling, ...) cannot be written in JSON Schema; docs/api.md lists them.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from vllm.entrypoints.openai.json_types import X_BOUND
from vllm.entrypoints.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorResponse,
)
from vllm.sampling_params import (
    FLOAT32_MAX,
    FLOAT32_MIN_NORMAL,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    REPETITION_PENALTY_RANGE,
)

_ERRORS = {
    400: "The request is invalid (the message names the field and the reason).",
    401: "The API key is missing or wrong (only when the server has one).",
    404: "The model is not served here.",
    408: "The request body did not arrive in time (--body-timeout).",
    413: "The request body is too large (--max-request-body-bytes).",
    500: "The server failed (the details are in its log) or its engine is dead.",
    503: "The server is busy (--max-queued-requests, --max-queued-images): retry later.",
}
# What a route may answer besides its 200.
BODY_ERRORS = (400, 401, 408, 413, 500)
GENERATION_ERRORS = (*BODY_ERRORS, 404, 503)


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: each status with vLLM's error body."""
    return {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in codes}


# Bodies the schema names without a route declaring them (stream chunks, /invocations).
SCHEMA_MODELS = (
    ChatCompletionResponse,
    CompletionResponse,
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
    ErrorResponse,
)


def _ref(model: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def json_or_stream(
    responses: tuple[type, ...], chunks: tuple[type, ...]
) -> dict[int | str, dict[str, Any]]:
    """The 200 of a generation route: a JSON body (one of ``responses``), or with ``stream``
    server-sent events whose data is a chunk (or an in-band error), then ``[DONE]``."""
    body = _ref(responses[0]) if len(responses) == 1 else {"anyOf": [_ref(m) for m in responses]}
    payload = {"anyOf": [*(_ref(m) for m in chunks), _ref(ErrorResponse)]}
    data = {
        "type": "string",
        "anyOf": [
            {"const": "[DONE]"},
            {"contentMediaType": "application/json", "contentSchema": payload},
        ],
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    content = {"application/json": {"schema": body}, "text/event-stream": {"schema": event}}
    return {200: {"description": "The response, or its stream.", "content": content}}


def _float32(low: float, high: float) -> dict[str, Any]:
    """[low, high] as the sampler's float32 takes it: 0, or a magnitude it holds (no
    subnormals)."""
    parts: list[dict[str, Any]] = [{"const": 0}]
    if high >= FLOAT32_MIN_NORMAL:
        parts.append({"minimum": max(low, FLOAT32_MIN_NORMAL), "maximum": high})
    if low <= -FLOAT32_MIN_NORMAL:
        parts.append({"minimum": low, "maximum": min(high, -FLOAT32_MIN_NORMAL)})
    return {"anyOf": parts}


class ByType(dict):
    """Constraints per JSON type, for a property that takes several (a string or a list)."""


_NON_EMPTY = {"type": "string", "minLength": 1}
_SAMPLING = {
    "frequency_penalty": _float32(-2.0, 2.0),
    "presence_penalty": _float32(-2.0, 2.0),
    "repetition_penalty": dict(zip(("minimum", "maximum"), REPETITION_PENALTY_RANGE, strict=True)),
    "temperature": {"minimum": 0, "maximum": FLOAT32_MAX},
    "top_p": {"minimum": FLOAT32_MIN_NORMAL, "maximum": 1},
    "min_p": _float32(0.0, 1.0),
    "top_k": {"minimum": -1},
    # Restated: FastAPI's document model holds bounds as floats, and 2**63 - 1 is not one.
    "seed": {"minimum": INT64_MIN, "maximum": INT64_MAX},
    "n": {"minimum": 1, X_BOUND: "n"},
    "best_of": {"minimum": 1, X_BOUND: "n"},
    "min_tokens": {"minimum": 0},
    "prompt_logprobs": {"minimum": 0, X_BOUND: "logprobs"},
    "stop": ByType(
        string={"minLength": 1, "maxLength": MAX_STOP_CHARS},
        array={"items": _NON_EMPTY, "maxItems": MAX_STOP_STRINGS},
    ),
    "logit_bias": {"propertyNames": {"pattern": "^[0-9]+$"}, X_BOUND: "vocab_items"},
    "allowed_token_ids": {"minItems": 1, X_BOUND: "vocab_items"},
    "stop_token_ids": {X_BOUND: "vocab_items"},
    "bad_words": {"maxItems": 0, "description": "Not supported yet: must be empty."},
    "use_beam_search": {"enum": [False], "description": "Not supported yet."},
    "response_format": {"properties": {"type": {"enum": ["text"]}}},
}
# A message's text (the rendered conversation must fit: a rule over all of them, see api.md).
_TEXT = {"type": "string"}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": _TEXT},
}
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "anyOf": [
                _NON_EMPTY,
                {
                    "type": "object",
                    "required": ["url"],
                    "properties": {"url": _NON_EMPTY},
                },
            ]
        },
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "anyOf": [
                _TEXT,
                {"type": "null"},
                {"type": "array", "items": {"anyOf": [_TEXT, _TEXT_PART, _IMAGE_PART]}},
            ]
        },
    },
}
_CHAT_ONLY = {
    "messages": {"items": _MESSAGE, X_BOUND: "tokens"},
    "top_logprobs": {"minimum": 0, X_BOUND: "logprobs"},
    "max_tokens": {X_BOUND: "max_tokens"},
    "max_completion_tokens": {X_BOUND: "max_tokens"},
    "echo": {"enum": [False], "description": "Not supported in chat."},
    "mm_processor_kwargs": {"maxProperties": 0, "description": "Not supported yet."},
    "chat_template": {X_BOUND: "chat_template"},
}
# The one cross-field rule a schema states simply: no generation prompt after a continued final
# message (add_generation_prompt defaults to true).
_CONTINUE_XOR_GENERATE = {
    "not": {
        "required": ["continue_final_message"],
        "properties": {
            "continue_final_message": {"const": True},
            "add_generation_prompt": {"const": True},
        },
    }
}
# An empty text without the BOS token is no prompt at all.
_NO_EMPTY_PROMPT = {
    "not": {
        "required": ["add_special_tokens"],
        "properties": {
            "add_special_tokens": {"const": False},
            "prompt": {"anyOf": [{"const": ""}, {"type": "array", "contains": {"const": ""}}]},
        },
    }
}
MODEL_SCHEMAS: dict[str, dict[str, Any]] = {
    "ChatCompletionRequest": _CONTINUE_XOR_GENERATE,
    "TokenizeChatRequest": _CONTINUE_XOR_GENERATE,
    "CompletionRequest": _NO_EMPTY_PROMPT,
}
FIELD_SCHEMAS: dict[str, dict[str, dict[str, Any]]] = {
    "ChatCompletionRequest": {**_SAMPLING, **_CHAT_ONLY},
    "CompletionRequest": {
        **_SAMPLING,
        "logprobs": {"minimum": 0, X_BOUND: "logprobs"},
        "max_tokens": {X_BOUND: "max_tokens"},
        "suffix": {"maxLength": 0, "description": "Not supported yet."},
    },
    "TokenizeChatRequest": {
        "messages": {"items": _MESSAGE, X_BOUND: "tokens"},
        "chat_template": {X_BOUND: "chat_template"},
    },
}


@dataclass(frozen=True)
class SchemaBounds:
    """This app's numbers, written into the schema where the server enforces them."""

    vocab_size: int  # sampled token ids: 0 .. vocab_size - 1
    tokenizer_size: int  # ids /detokenize takes (special tokens and <|image|> included)
    max_model_len: int
    max_prompts: int
    max_logprobs: int
    max_num_seqs: int
    trust_request_chat_template: bool
    max_prompt_chars: int  # a longer text cannot fit in max_model_len tokens
    served_model_names: tuple[str, ...] = ()

    def values(self, name: str, kind: str | None) -> dict[str, Any]:
        """The JSON Schema keywords the marker ``name`` stands for, on a schema of type
        ``kind``."""
        if name == "chat_template":
            return {} if self.trust_request_chat_template else {"type": "null"}
        if name == "vocab_items":  # a list or a map of token ids
            return {"maxProperties" if kind == "object" else "maxItems": self.vocab_size}
        return {
            "token_id": {"minimum": 0, "maximum": self.vocab_size - 1},
            "tokenizer_id": {"minimum": 0, "maximum": self.tokenizer_size - 1},
            "tokens": {"maxItems": self.max_model_len},
            "prompts": {"maxItems": self.max_prompts},
            "logprobs": {"maximum": self.max_logprobs},
            "n": {"maximum": min(self.max_num_seqs, MAX_N)},
            "max_tokens": {"maximum": self.max_model_len - 1},
            "prompt_chars": {"maxLength": self.max_prompt_chars},
        }[name]


def _typed_branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The parts of a property's schema a constraint applies to (not its ``null``)."""
    if "anyOf" in prop:
        return [b for b in prop["anyOf"] if b.get("type") != "null"]
    return [prop]


def _resolve_markers(node: Any, bounds: SchemaBounds) -> None:
    """Replaces every ``x-vllm-bound`` marker by the keywords it stands for (in place)."""
    if isinstance(node, dict):
        name = node.pop(X_BOUND, None)
        for value in node.values():
            _resolve_markers(value, bounds)
        if name is not None:
            node.update(bounds.values(name, node.get("type")))
    elif isinstance(node, list):
        for value in node:
            _resolve_markers(value, bounds)


def _apply_field_schemas(schemas: dict[str, Any]) -> None:
    for model, extra in MODEL_SCHEMAS.items():
        schemas[model].update(copy.deepcopy(extra))
    for model, fields in FIELD_SCHEMAS.items():
        props = schemas[model]["properties"]
        for name, extra in fields.items():
            for branch in _typed_branches(props[name]):
                if isinstance(extra, ByType):
                    branch.update(copy.deepcopy(extra.get(branch.get("type"), {})))
                else:
                    branch.update(copy.deepcopy(extra))


def _drop_422(schema: dict[str, Any]) -> None:
    """FastAPI documents a 422 for bodies; the server answers 400 (vLLM's choice)."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)


def _add_models(schema: dict[str, Any]) -> None:
    """The components of ``SCHEMA_MODELS`` (and what they refer to)."""
    _, top = models_json_schema(
        [(m, "serialization") for m in SCHEMA_MODELS], ref_template="#/components/schemas/{model}"
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, definition in top.get("$defs", {}).items():
        components.setdefault(name, definition)


def _unique_operation_ids(schema: dict[str, Any]) -> None:
    """A route with several methods (``/ping``) gets one operation id per method."""
    for path in schema.get("paths", {}).values():
        if len(path) > 1:
            for method, operation in path.items():
                suffix = f"_{method}"
                op_id = operation.get("operationId", "")
                if op_id and not op_id.endswith(suffix):
                    operation["operationId"] = op_id + suffix


def _name_examples(schema: dict[str, Any], names: tuple[str, ...]) -> None:
    """The served names as examples of a model path parameter (``/v1/models/{model}``)."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            for param in operation.get("parameters", []):
                if param.get("name") == "model" and param.get("in") == "path" and names:
                    param["schema"]["examples"] = list(names)


def install_openapi(app: FastAPI, bounds: SchemaBounds) -> None:
    """``app.openapi`` builds (once) the schema with this app's bounds."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # the duplicate ids of /ping, made unique below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                schema = get_openapi(
                    title=app.title, version=app.version, routes=app.routes, summary=app.summary
                )
            _unique_operation_ids(schema)
            _name_examples(schema, bounds.served_model_names)
            _add_models(schema)
            _drop_422(schema)
            _apply_field_schemas(schema["components"]["schemas"])
            _resolve_markers(schema, bounds)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
