"""HTTP request metrics, under the names vLLM exposes (prometheus-fastapi-instrumentator's
defaults): requests by method, status class and handler, request and response sizes, and
latencies. ``handler`` is the route's template (``/v1/models/{model:path}``), or ``none`` for
a path no route serves, so clients cannot add series by inventing paths; the probes and the
scrape itself (``/metrics``, ``/health``, ``/ping``, ``/version``) are not counted, as in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/ping", "/version"})
HIGHR_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    4.5,
    5.0,
    7.5,
    10.0,
    30.0,
    60.0,
)


class HTTPMetrics:
    """The series, in one app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=registry,
        )
        self.request_size = Summary(
            "http_request_size_bytes",
            "Content length of incoming requests by handler. Only value of header is respected.",
            ["handler"],
            registry=registry,
        )
        self.response_size = Summary(
            "http_response_size_bytes",
            "Content length of outgoing responses by handler.",
            ["handler"],
            registry=registry,
        )
        self.latency_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels.",
            buckets=HIGHR_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler.",
            ["method", "handler"],
            buckets=(0.1, 0.5, 1.0),
            registry=registry,
        )

    def observe(
        self,
        method: str,
        status: int,
        handler: str,
        request_bytes: int,
        response_bytes: int,
        seconds: float,
    ) -> None:
        self.requests.labels(method, f"{status // 100}xx", handler).inc()
        self.request_size.labels(handler).observe(request_bytes)
        self.response_size.labels(handler).observe(response_bytes)
        self.latency_highr.observe(seconds)
        self.latency.labels(method, handler).observe(seconds)


def route_template(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The template of the route serving ``scope``, or ``none``."""
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", "none"))
    return "none"


class HTTPMetricsMiddleware:
    """Counts every HTTP request, whoever answers it (a 401 or 413 from an inner middleware
    too); a streamed response is timed until its last byte."""

    def __init__(self, app: ASGIApp, metrics: HTTPMetrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        handler = route_template(self.routes, scope)
        if handler in EXCLUDED_HANDLERS:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        seen: dict[str, Any] = {"status": 500, "bytes": 0}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            length = dict(scope.get("headers", [])).get(b"content-length", b"0")
            self.metrics.observe(
                scope.get("method", ""),
                seen["status"],
                handler,
                int(length) if length.isdigit() else 0,
                seen["bytes"],
                time.perf_counter() - start,
            )
