"""uvicorn, with the connection limits it lacks: a deadline for a request's headers and a cap
on open connections (uvicorn's own ``limit_concurrency`` only answers 503 to requests).

uvicorn arms no timer on a new connection and cancels its keep-alive timer whenever data
arrives, so a client that connects and sends nothing, or sends its headers a byte at a time,
holds a connection for ever. :class:`LimitedH11Protocol` arms a header deadline when a
connection opens and whenever it waits for a new request's head, and closes the connection
if the head is not complete in time; the body then has its own deadline
(``BodySizeLimitMiddleware``).

It also turns Nagle's algorithm off on every connection (``TCP_NODELAY``). asyncio does so only
for sockets whose protocol number is ``IPPROTO_TCP``, which a socket made with the default
protocol 0 (as the listening socket handed to uvicorn may be) is not; with Nagle on, each
small write of a stream (the first SSE chunk after the headers, then each token's chunk) waits
for the client's acknowledgement of the previous one, which clients delay by up to 40 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllm.entrypoints.openai.server_limits import ServerLimits


class LimitedH11Protocol(H11Protocol):
    """h11 protocol with a header deadline and a connection cap (set by :func:`protocol_for`)."""

    header_timeout: float = 10.0
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        set_nodelay(transport)
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self.transport.close()  # over the cap: the client sees the connection close
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # (part of) a request head: it must complete in time
        else:
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_head_timer()  # the keep-alive timer covers the idle time until new data

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:  # from the first byte: trickling does not extend it
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug("Closing a connection whose request headers did not arrive in time")
            self.transport.close()


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Turns Nagle's algorithm off on the transport's TCP socket (nothing for other sockets)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # the peer may be gone already
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def protocol_for(limits: ServerLimits) -> type[LimitedH11Protocol]:
    """A protocol class carrying ``limits`` (uvicorn builds one instance per connection)."""
    return type(
        "ServerH11Protocol",
        (LimitedH11Protocol,),
        {"header_timeout": limits.header_timeout, "max_connections": limits.limit_concurrency},
    )


def uvicorn_config(app: Any, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` under ``limits`` (``kwargs``: logging, TLS, shutdown)."""
    return uvicorn.Config(
        app,
        http=protocol_for(limits),
        limit_concurrency=limits.limit_concurrency,
        timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]
        **kwargs,
    )
