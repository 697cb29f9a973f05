"""ASGI middleware of the OpenAI server: API-key check and request-body size limit."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm.entrypoints.openai.serving_engine import error_body


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*`` (health and metrics stay open).

    Pure ASGI, so streamed responses and disconnect detection pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if not path.startswith("/v1"):
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a request whose body is over ``max_bytes``: from ``Content-Length``
    before reading any of it, or while buffering a chunked body (which is then replayed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(scope, receive, send, f"{int(length)} bytes")
        if length or b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes:
                return await self._reject(scope, receive, send, f"over {self.max_bytes} bytes")
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Any:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (
            f"The request body is too large ({size}); the limit is {self.max_bytes} bytes "
            "(--max-request-body-bytes)."
        )
        body = error_body(message, "RequestTooLargeError", 413)
        response = JSONResponse(body, 413, headers={"Connection": "close"})
        await response(scope, receive, send)
