"""Server-sent events as OpenAI streams them, and the HTTP plumbing around a stream.

    data: {chunk json}\\n\\n      one event per chunk
    data: {"error": {...}}\\n\\n  when the request fails after the stream started
    data: [DONE]\\n\\n            always last, also after an error

A stream's status line (200) is sent before the first chunk, so failures after that
point can only be reported in-band, as the error event above (vLLM does the same).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvflow.services.frontend.errors import (
    CLIENT_CLOSED_REQUEST,
    ErrorInfo,
    ErrorResponse,
    RequestTooLargeError,
    error_info,
)

SSE_DONE = b"data: [DONE]\n\n"
T = TypeVar("T")
_ENCODER = msgspec.json.Encoder()


def sse_event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


async def sse_body(chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """`chunks`, then [DONE]; an exception becomes an error event before [DONE]."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except Exception as exc:
        status, info = error_info(exc)
        yield sse_event(ErrorResponse(ErrorInfo(info.message, info.type, info.param, status)))
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """A text/event-stream response that stops, and closes its body generator, as soon
    as the client disconnects — also while no chunk is due (a long prefill), whatever
    ASGI spec version the server reports (Starlette only watches for disconnects below
    2.4). Closing the generator runs the `finally` blocks that abort the request."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None]) -> None:
        super().__init__(sse_body(chunks), headers={"Cache-Control": "no-cache"})
        self._body: AsyncGenerator[bytes, None] = self.body_iterator  # type: ignore[assignment]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self.stream_response(send))
        finally:
            await self._body.aclose()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(limit)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise RequestTooLargeError(limit)
        parts.append(part)
    return b"".join(parts)


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """A non-streaming request's response, or 499 if the client left first (its
    generation is then aborted instead of running to the end unread)."""
    response = await unless_disconnected(request.receive, work)
    return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it, let its cleanup run,
    and return None. Call only after the request body was read: from then on the
    server's receive() returns nothing but the disconnect."""
    work_task: asyncio.Future[T] = asyncio.ensure_future(work)
    watch_task: asyncio.Future[None] = asyncio.ensure_future(_wait_for_disconnect(receive))
    pending: set[asyncio.Future[object]] = {work_task, watch_task}  # type: ignore[arg-type]
    try:
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    return None if work_task.cancelled() else work_task.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
