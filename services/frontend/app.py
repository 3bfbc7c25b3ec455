"""The frontend's ASGI app (Starlette): OpenAI routes, health, metrics, version, OpenAPI,
and the web UI (web_ui.py).

    ─▶ HttpMetricsMiddleware (count + duration by route template and status)
       ─▶ router ─▶ _guarded: API key (all but /health, /metrics) ─▶ endpoint:
                    read the body (bounded) ─▶ handler ─▶ Response
                    any exception ─▶ errors.error_response (OpenAI JSON)

The engine client is started by the app's lifespan (unless the caller started it) and
closed with it, so it lives on the server's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.runtime.cluster_auth import cluster_settings
from kvflow.services.frontend.chat_images import chat_images
from kvflow.services.frontend.config import FrontendConfig
from kvflow.services.frontend.engine_client import EngineClient
from kvflow.services.frontend.engine_view import EngineView
from kvflow.services.frontend.errors import APIError, error_response
from kvflow.services.frontend.health import degraded_health
from kvflow.services.frontend.kv_params import KVParamsGate
from kvflow.services.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from kvflow.services.frontend.metrics_fanin import PUBLISH_S, SharedProcessMetrics
from kvflow.services.frontend.openapi import openapi_document
from kvflow.services.frontend.reasoning import AUTO, auto_reasoning_parser
from kvflow.services.frontend.responses import VersionResponse
from kvflow.services.frontend.routing_metrics import RoutingMetrics
from kvflow.services.frontend.serving_chat import create_chat_completion
from kvflow.services.frontend.serving_common import ServingContext, json_response
from kvflow.services.frontend.serving_completions import create_completion
from kvflow.services.frontend.serving_embeddings import create_embedding, create_pooling
from kvflow.services.frontend.serving_lora import load_lora_adapter, unload_lora_adapter
from kvflow.services.frontend.serving_responses import ResponsesAPI
from kvflow.services.frontend.serving_tokenize import detokenize, list_models, tokenize
from kvflow.services.frontend.sse import read_body
from kvflow.services.frontend.web_ui import ASSETS, UIConfig, WebUI
from kvflow.version import __version__

logger = logging.getLogger(__name__)

__all__ = ["FrontendConfig", "build_app"]

# Reachable without the API key: /health and /metrics as in vLLM, and the web UI's page,
# which asks for the key (its stats stream, /ui/stats, needs it).
OPEN_PATHS = frozenset({"/health", "/metrics", *ASSETS})
Endpoint = Callable[[Request], Awaitable[Response]]


def build_app(
    config: FrontendConfig,
    engine_client: EngineClient,
    tokenizer: Any,
    metrics: FrontendMetrics | None = None,
) -> Starlette:
    """The app; `tokenizer` is the model's HF tokenizer, loaded once by the caller.
    `metrics` defaults to a fresh private registry (pass one to read it in tests)."""
    metrics = metrics or FrontendMetrics(
        config.served_model_name, config.max_model_len, config.engine_label
    )
    engine_client.add_stats_listener(metrics.observe_scheduler_stats)
    routing = RoutingMetrics(
        metrics.process_registry, config.served_model_name, len(engine_client.engines)
    )
    engine_client.add_route_listener(routing.observe)
    view = EngineView()
    engine_client.add_stats_listener(view.observe)
    if config.reasoning_parser == AUTO:
        chosen = auto_reasoning_parser(tokenizer)
        logger.info("--reasoning-parser auto: %s (from the chat template)", chosen or "none")
        config = dataclasses.replace(config, reasoning_parser=chosen)
    kv_params = KVParamsGate(cluster_settings().secret, metrics.count_kv_params_rejected)
    ctx = ServingContext(config, engine_client, tokenizer, metrics, kv_params)
    images = config.vision_model_dir is not None
    if images:  # the model's processor loads now, not in the event loop on the first image
        chat_images(config.media, config.vision_model_dir)
    web_ui = WebUI(view, UIConfig(images, config.media.limits.max_images if images else 0))

    shared = None
    if config.metrics_dir is not None:  # one of several API servers on the port
        shared = metrics.share(Path(config.metrics_dir), config.frontend_id)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not engine_client.started:
            await engine_client.start()
        publisher = asyncio.create_task(_publish(shared)) if shared is not None else None
        try:
            yield
        finally:
            if publisher is not None and shared is not None:
                publisher.cancel()
                shared.withdraw()
            await engine_client.close()

    app = Starlette(
        routes=_routes(ctx, engine_client, web_ui),
        middleware=[Middleware(HttpMetricsMiddleware, metrics=metrics)],
        exception_handlers={HTTPException: _http_exception},
        lifespan=lifespan,
    )
    app.state.serving = ctx
    app.state.web_ui = web_ui  # main.py ends its stats streams at shutdown
    return app


async def _publish(shared: SharedProcessMetrics) -> None:
    """Keep this API server's share fresh for scrapes that reach a sibling."""
    while True:
        shared.publish()
        await asyncio.sleep(PUBLISH_S)


class _Endpoints:
    """The route handlers; each gets the request and returns a response or raises."""

    def __init__(self, ctx: ServingContext, engine_client: EngineClient) -> None:
        self.ctx = ctx
        self.engine_client = engine_client
        self.limit = ctx.config.max_body_bytes
        self.openapi = msgspec.json.encode(openapi_document())
        self.responses = ResponsesAPI(ctx)

    async def completions(self, request: Request) -> Response:
        return await create_completion(self.ctx, request, await read_body(request, self.limit))

    async def chat(self, request: Request) -> Response:
        body = await read_body(request, self.limit)
        return await create_chat_completion(self.ctx, request, body)

    async def embeddings(self, request: Request) -> Response:
        return await create_embedding(self.ctx, request, await read_body(request, self.limit))

    async def pooling(self, request: Request) -> Response:
        return await create_pooling(self.ctx, request, await read_body(request, self.limit))

    async def tokenize(self, request: Request) -> Response:
        return tokenize(self.ctx, await read_body(request, self.limit))

    async def detokenize(self, request: Request) -> Response:
        return detokenize(self.ctx, await read_body(request, self.limit))

    async def models(self, request: Request) -> Response:
        return list_models(self.ctx)

    async def load_lora(self, request: Request) -> Response:
        return load_lora_adapter(self.ctx.lora, await read_body(request, self.limit))

    async def unload_lora(self, request: Request) -> Response:
        return unload_lora_adapter(self.ctx.lora, await read_body(request, self.limit))

    async def health(self, request: Request) -> Response:
        problem = self.engine_client.health_problem()
        if problem is None and self.engine_client.is_degraded:
            return degraded_health(self.engine_client.engine_problems())
        if problem is None:
            return Response(status_code=HTTPStatus.OK)
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, problem, error_type="service_unavailable")

    async def metrics(self, request: Request) -> Response:
        return Response(self.ctx.metrics.render(), media_type=CONTENT_TYPE)

    async def version(self, request: Request) -> Response:
        return json_response(VersionResponse(version=__version__))

    async def openapi_json(self, request: Request) -> Response:
        return Response(self.openapi, media_type="application/json")


def _routes(ctx: ServingContext, engine_client: EngineClient, web_ui: WebUI) -> list[Route]:
    e = _Endpoints(ctx, engine_client)
    table: list[tuple[str, str, Endpoint]] = [
        ("POST", "/v1/completions", e.completions),
        ("POST", "/v1/chat/completions", e.chat),
        ("POST", "/v1/responses", e.responses.create),
        ("GET", "/v1/responses/{response_id}", e.responses.retrieve),
        ("POST", "/v1/embeddings", e.embeddings),
        ("POST", "/pooling", e.pooling),
        ("GET", "/v1/models", e.models),
        ("POST", "/v1/load_lora_adapter", e.load_lora),
        ("POST", "/v1/unload_lora_adapter", e.unload_lora),
        ("POST", "/tokenize", e.tokenize),
        ("POST", "/detokenize", e.detokenize),
        ("GET", "/health", e.health),
        ("GET", "/metrics", e.metrics),
        ("GET", "/version", e.version),
        ("GET", "/openapi.json", e.openapi_json),
        ("GET", "/ui/stats", web_ui.stats),
        ("GET", "/ui/config", web_ui.ui_config),
        *[("GET", path, web_ui.asset) for path in ASSETS],
    ]
    api_key = ctx.config.api_key
    return [
        Route(path, _guarded(endpoint, None if path in OPEN_PATHS else api_key), methods=[method])
        for method, path, endpoint in table
    ]


def _guarded(endpoint: Endpoint, api_key: str | None) -> Endpoint:
    """Checks the API key, and turns every failure of the handler into an OpenAI error
    reply (never a dropped connection); error_info logs unexpected ones."""
    expected = api_key.encode() if api_key else None

    async def guarded(request: Request) -> Response:
        try:
            if expected is not None:
                check_api_key(request.headers.get("authorization", ""), expected)
            return await endpoint(request)
        except Exception as exc:
            return error_response(exc)

    guarded.__name__ = endpoint.__name__
    return guarded


def check_api_key(authorization: str, expected: bytes) -> None:
    """Raise 401 unless the header is `Bearer <key>`; the scheme is case-insensitive
    (RFC 9110 11.1), the key is compared in constant time."""
    scheme, _, given = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise APIError(
            HTTPStatus.UNAUTHORIZED,
            "missing or invalid API key (send 'Authorization: Bearer <key>')",
            error_type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="kvflow"'},
        )


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (wrong method, with its `Allow`
    header), in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    headers = dict(exc.headers) if exc.headers is not None else None
    error = APIError(exc.status_code, exc.detail, error_type=error_type, headers=headers)
    return error_response(error)


class HttpMetricsMiddleware:
    """kvflow:http_requests_total and kvflow:http_request_duration_seconds.

    The route label is the matched route's path template, or "unmatched" (never the
    raw path: a scanner probing random URLs must not create unbounded label values)."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = HTTPStatus.INTERNAL_SERVER_ERROR.value

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            elapsed = time.perf_counter() - start
            self.metrics.observe_http(label, scope["method"], status, elapsed)
