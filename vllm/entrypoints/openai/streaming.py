"""Server-sent events and async-iterator plumbing for streamed responses.

A streamed response must stop its request as soon as the client goes away: the engine frees the
request's KV pages when its output generator is closed. :class:`SSEResponse` therefore watches
for the disconnect itself (whatever ASGI spec version the server speaks) and always closes its
body iterator, whose ``finally`` blocks close the engine generators in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: str) -> str:
    """One SSE event carrying a JSON payload."""
    return f"data: {payload}\n\n"


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that ends (and closes its iterator) on client disconnect;
    ``on_close`` runs when it ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, on_close: Callable[[], None] | None = None) -> None:
        super().__init__(content)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the socket went away mid-send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                with anyio.CancelScope(shield=True):
                    await closer()
            if self.on_close is not None:
                self.on_close()


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client of a (body-consumed) request disconnects."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def merge_async_iterators(
    iterators: list[AsyncGenerator[T, None]],
) -> AsyncIterator[tuple[int, T]]:
    """Yields ``(i, item)`` from several async generators as items arrive.

    Exceptions from any generator propagate; on exit (normal, error or close) the pumping tasks
    are cancelled and every generator is closed.
    """
    if len(iterators) == 1:
        async with contextlib.aclosing(iterators[0]) as it:
            async for item in it:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncGenerator[T, None]) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:
            await queue.put((i, done, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in iterators:
            await it.aclose()
