"""The built-in web UI: three static files (ui/index.html, ui/app.js, ui/app.css) and
the engine view's stats stream.

    GET /, /ui        index.html            open: the page asks for the API key itself
    GET /ui/app.js    the whole app         open
    GET /ui/app.css   its styles            open
    GET /ui/stats     SSE: engine_view snapshots, at most 2 a second   API key
    GET /ui/config    what the playground offers: {"images": bool, "max_images": int}   API key

The files are package data, read once at start-up: no build step, no framework, no
network at run time (docs/design.md, "Web UI").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from importlib import resources

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvflow.services.frontend.engine_view import MAX_UPDATES_PER_S, EngineView
from kvflow.services.frontend.sse import SSEResponse

ASSETS = {  # path -> (file under ui/, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
# The page runs nothing but its own script and styles, and talks only to this server.
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


class UIConfig(msgspec.Struct, frozen=True):
    """What the playground offers for this server's model."""

    images: bool = False  # the model reads images: the composer takes them
    max_images: int = 0  # per request (--limit-mm-per-prompt)


class WebUI:
    def __init__(self, view: EngineView, config: UIConfig | None = None) -> None:
        self.view = view
        self.config = msgspec.json.encode(config or UIConfig())
        folder = resources.files("kvflow.services.frontend") / "ui"
        self.files = {name: (folder / name).read_bytes() for name, _ in ASSETS.values()}
        self._closing = asyncio.Event()

    async def asset(self, request: Request) -> Response:
        name, media_type = ASSETS[request.url.path.rstrip("/") or "/"]
        return Response(self.files[name], media_type=media_type, headers=_HEADERS)

    async def ui_config(self, request: Request) -> Response:
        return Response(self.config, media_type="application/json", headers=_HEADERS)

    async def stats(self, request: Request) -> Response:
        return SSEResponse(self._snapshots())

    def close(self) -> None:
        """End the open stats streams (server shutdown: they would never end alone)."""
        self._closing.set()

    async def _snapshots(self) -> AsyncGenerator[bytes, None]:
        encoder = msgspec.json.Encoder()
        while not self._closing.is_set():
            yield b"data: " + encoder.encode(self.view.snapshot()) + b"\n\n"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), 1.0 / MAX_UPDATES_PER_S)
