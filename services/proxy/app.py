"""The proxy's HTTP app (Starlette): prefill, then decode, streaming the decode's answer.

    client ─POST /v1/chat/completions─▶ proxy ─(max_tokens=1)─▶ prefill instance
                                              │   (its KV saved through the connector)
                                              └─(the request as sent)─▶ decode instance
    client ◀──────── decode's status, headers and body (SSE streamed as it comes) ──┘

A prefill that fails (instance down, error status) is logged and the request still
goes to decode: with shared storage the decode instance loads only blocks that exist
and computes the rest; with zmq its pull fails after --kv-load-timeout and its
--kv-load-failure-policy decides (recompute: the answer, later; fail: an error). Usage and timings are the decode
instance's, which counts the whole prompt as its own (as one server would).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvflow.cluster_secret import ClusterSecret
from kvflow.errors import ConfigError
from kvflow.services.proxy.pairing import InstancePools, decode_request, prefill_request

logger = logging.getLogger(__name__)

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class ProxyCounters:
    def __init__(self) -> None:
        self.requests = 0
        self.prefill_failures = 0


def build_app(
    pools: InstancePools, timeout_s: float = 600.0, secret: ClusterSecret | None = None
) -> Starlette:
    """`secret` signs the decode requests' kv_transfer_params (needed with KV addresses)."""
    if pools.prefill_kv_addresses and secret is None:
        raise ConfigError(
            "--prefill-kv-address needs the cluster secret (--cluster-secret-file): decode "
            "instances pull KV only from an address the proxy signed"
        )
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
    counters = ProxyCounters()

    async def forward(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        counters.requests += 1
        prefill_url, kv_address, decode_url = pools.pick()
        headers = _auth(request)
        await _prefill(client, prefill_url + request.url.path, body, headers, counters)
        upstream = client.build_request(
            "POST",
            decode_url + request.url.path,
            json=decode_request(body, kv_address, secret, time.time()),
            headers=headers,
        )
        response = await client.send(upstream, stream=True)
        return StreamingResponse(
            _relay(response),
            status_code=response.status_code,
            headers={k: v for k, v in response.headers.items() if k not in _HOP_HEADERS},
            background=BackgroundTask(response.aclose),
        )

    async def models(request: Request) -> Response:
        response = await client.get(pools.decode_urls[0] + "/v1/models", headers=_auth(request))
        return Response(response.content, response.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "prefill": pools.prefill_urls,
                "decode": pools.decode_urls,
                "requests": counters.requests,
                "prefill_failures": counters.prefill_failures,
            }
        )

    routes = [
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


async def _prefill(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    counters: ProxyCounters,
) -> None:
    try:
        response = await client.post(url, json=prefill_request(body), headers=headers)
    except httpx.HTTPError as exc:
        counters.prefill_failures += 1
        logger.warning("prefill at %s failed (%s): decode computes the prompt", url, exc)
        return
    if response.status_code != 200:
        counters.prefill_failures += 1
        logger.warning(
            "prefill at %s answered %d: decode computes the prompt", url, response.status_code
        )


async def _relay(response: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in response.aiter_raw():
        yield chunk


def _auth(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}
