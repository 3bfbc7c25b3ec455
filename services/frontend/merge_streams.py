"""Several async streams read as one: the choices of a request, as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


async def merge_streams(
    streams: list[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async generators as they arrive, tagged with the source index.

    The first exception of any source is re-raised; on exit (normal, error, close or
    cancellation) every source is closed, which is what aborts engine requests."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
            return
        queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
