"""The routes of the OpenAI-compatible server and what the published schema says of each.

``/health`` and SageMaker's ``/ping`` (empty bodies), ``/version``, ``/metrics``, the models
(``/v1/models``, ``/v1/models/{id}``), chat and completions, SageMaker's ``/invocations`` (a
chat or a completion body), ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.responses import PlainTextResponse, Response

from vllm.engine.async_llm_engine import EngineDeadError
from vllm.entrypoints.openai.metrics import CONTENT_TYPE
from vllm.entrypoints.openai.openapi import (
    BODY_ERRORS,
    GENERATION_ERRORS,
    error_responses,
    json_or_stream,
)
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import OpenAIServingError, ServerContext
from vllm.entrypoints.openai.serving_models import (
    ModelCard,
    ModelList,
    show_available_models,
    show_model,
)
from vllm.entrypoints.openai.serving_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIServingTokenization,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.version import __version__

_NO_BODY: dict[str, Any] = {"content": {}}
_HEALTH = {
    200: {"description": "The engine is running (an empty body).", **_NO_BODY},
    503: {"description": "The engine is dead (an empty body).", **_NO_BODY},
}
# /metrics answers Prometheus text; its 401 (with --enable-metrics-auth) is still JSON.
_METRICS_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {
        "description": "The API key is missing or wrong (with --enable-metrics-auth).",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
}
_INVOCATION_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/ChatCompletionRequest"},
                        {"$ref": "#/components/schemas/CompletionRequest"},
                    ]
                }
            }
        },
    }
}


def _add_probe_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Health (``/health``, SageMaker's ``/ping``), version and metrics."""

    async def health() -> Response:
        try:
            await ctx.engine.check_health()
        except EngineDeadError:
            return Response(status_code=503)
        return Response(status_code=200)

    for path, methods in (("/health", ["GET"]), ("/ping", ["GET", "POST"])):
        app.add_api_route(path, health, methods=methods, response_class=Response, responses=_HEALTH)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=_METRICS_ERRORS)
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def parse_json_body(body: bytes) -> Any:
    """``json.loads(body)``, faster: pydantic-core's parser (about 7x faster on a chat body
    that carries a 1.5 MB data URL: ``python -m benchmarks.profiling inputs``), with
    ``json.loads`` itself on anything that parser refuses (lone surrogates, a BOM, UTF-16,
    every malformed body), so each body is either read as ``json.loads`` reads it or fails
    with ``json.loads``'s own error."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return json.loads(body)


class JSONBodyRequest(Request):
    """A request whose JSON body is read by ``parse_json_body`` (FastAPI reads a body
    parameter through ``Request.json``, as do the routes that parse their own body)."""

    async def json(self) -> Any:
        if not hasattr(self, "_parsed_json"):
            self._parsed_json = parse_json_body(await self.body())
        return self._parsed_json


class JSONBodyRoute(APIRoute):
    """Routes whose handlers get a ``JSONBodyRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return route


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Every route of the server, over the handlers of ``ctx`` (``JSONBodyRoute``s)."""
    app.router.route_class = JSONBodyRoute
    chat = OpenAIServingChat(ctx)
    completion = OpenAIServingCompletion(ctx)
    tokenization = OpenAIServingTokenization(ctx)
    _add_probe_routes(app, ctx)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def show_models() -> dict[str, Any]:
        return show_available_models(ctx).model_dump()

    @app.get(
        "/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(401, 404)
    )
    async def retrieve_model(model: str) -> dict[str, Any]:
        return show_model(ctx, model).model_dump()

    errors = error_responses(*GENERATION_ERRORS)
    chat_responses = (ChatCompletionResponse,), (ChatCompletionStreamResponse,)
    completion_responses = (CompletionResponse,), (CompletionStreamResponse,)

    @app.post("/v1/chat/completions", responses={**json_or_stream(*chat_responses), **errors})
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/completions", responses={**json_or_stream(*completion_responses), **errors})
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    either = tuple(a + b for a, b in zip(chat_responses, completion_responses, strict=True))

    @app.post(
        "/invocations",
        responses={**json_or_stream(*either), **errors},
        openapi_extra=_INVOCATION_BODY,
    )
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's inference route: a chat body (``messages``) or a completion body
        (``prompt``), answered as on its own route."""
        body = await _json_object(raw_request)
        if "messages" in body:
            request = _validated(ChatCompletionRequest, body)
            return await chat.create_chat_completion(request, raw_request)
        if "prompt" in body:
            request = _validated(CompletionRequest, body)
            return await completion.create_completion(request, raw_request)
        raise OpenAIServingError(
            "The body must hold `messages` (a chat completion) or `prompt` (a completion)."
        )

    tokenizer_errors = error_responses(*BODY_ERRORS, 404)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=tokenizer_errors)
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        return (await tokenization.create_tokenize(request)).model_dump()

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=tokenizer_errors)
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        return (await tokenization.create_detokenize(request)).model_dump()


async def _json_object(raw_request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400."""
    try:
        body = await raw_request.json()
    except ValueError as e:  # JSON or UTF-8 errors
        raise OpenAIServingError(f"The body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIServingError("The body must be a JSON object.")
    return body


def _validated(model: type[Any], body: dict[str, Any]) -> Any:
    """``model`` from ``body``; its errors answered like those of a route's own body."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
