"""ASGI middleware of the OpenAI server: the API-key check, the request-body limits (size and
time), and the per-request bounds the body validators read."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm.entrypoints.openai.request_checks import REQUEST_LIMITS, RequestLimits
from vllm.entrypoints.openai.serving_engine import error_body

# Paths that need the key when one is set: the API (SageMaker's /invocations too), and the
# tokenizer endpoints (they run the chat template). /health, /ping, /version and (unless
# asked) /metrics stay open for probes.
PROTECTED_PREFIXES = ("/v1", "/invocations", "/tokenize", "/detokenize")
UNAUTHORIZED = "Unauthorized: send 'Authorization: Bearer <key>' with the server's API key."


def unauthorized() -> JSONResponse:
    """The 401: OpenAI's error body, and the scheme the client should use."""
    body = error_body(UNAUTHORIZED, "AuthenticationError", 401)
    return JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the protected paths, with any one of the
    server's keys (``--api-key a b``: several clients, or a key being rotated).

    Pure ASGI, so streamed responses and disconnect detection pass through untouched.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | Iterable[str],
        protected: Iterable[str] = PROTECTED_PREFIXES,
    ) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self.expected = [f"Bearer {key}".encode() for key in keys]
        self.protected = tuple(protected)

    def _needs_key(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        return path.startswith(self.protected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        if not self._needs_key(scope):
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        # Every key is compared (no early exit), so the time taken does not tell which matched.
        matches = [hmac.compare_digest(given, key) for key in self.expected]
        if any(matches):
            return await self.app(scope, receive, send)
        await unauthorized()(scope, receive, send)


class BodySizeLimitMiddleware:
    """Reads every request body before the app runs, counting the bytes actually received
    (whatever ``Content-Length`` or ``Transfer-Encoding`` say), and answers 413 past
    ``max_bytes`` (at once when ``Content-Length`` already says so) and 408 when the body
    takes longer than ``timeout`` seconds. The app then gets the body as one message."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(scope, receive, send, f"{int(length)} bytes")
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            return await self._timed_out(scope, receive, send)
        if body is None:
            return  # the client went away before sending its body
        if len(body) > self.max_bytes:
            return await self._reject(scope, receive, send, f"over {self.max_bytes} bytes")
        pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> Any:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The body, or None on disconnect; stops reading one chunk past the limit."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_bytes or not message.get("more_body", False):
                return b"".join(chunks)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (
            f"The request body is too large ({size}); the limit is {self.max_bytes} bytes "
            "(--max-request-body-bytes)."
        )
        body = error_body(message, "RequestTooLargeError", 413)
        response = JSONResponse(body, 413, headers={"Connection": "close"})
        await response(scope, receive, send)

    async def _timed_out(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"The request body did not arrive within {self.timeout:g} s (--body-timeout)."
        body = error_body(message, "RequestTimeoutError", 408)
        response = JSONResponse(body, 408, headers={"Connection": "close"})
        await response(scope, receive, send)


class RequestLimitsMiddleware:
    """Makes this app's :class:`RequestLimits` visible to the request-body validators (which
    run before any handler) for the duration of each request."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = REQUEST_LIMITS.set(self.limits)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_LIMITS.reset(token)
