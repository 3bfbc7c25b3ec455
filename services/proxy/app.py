"""The proxy's HTTP app (Starlette): prefill, then decode, streaming the decode's answer.

    client ─POST /v1/chat/completions─▶ proxy ─(max_tokens=1)─▶ prefill instance
                                              │   (its KV saved through the connector)
                                              └─(the request as sent)─▶ decode instance
    client ◀──────── decode's status, headers and body (SSE streamed as it comes) ──┘

A prefill that fails (instance down, error status) is logged and the request still
goes to decode: with shared storage the decode instance loads only blocks that exist
and computes the rest; with zmq its pull fails after --kv-load-timeout and its
--kv-load-failure-policy decides (recompute: the answer, later; fail: an error). A
decode instance that fails a request before the client has any of its answer (refused,
dropped, a 5xx) has it prefilled and sent again (decode_send.py, resend.py); one that
dies in the middle of a stream has the stream resumed elsewhere (resume.py). Usage and
timings are the decode instance's, which counts the whole prompt as its own (as one
server would).
"""

from __future__ import annotations

import contextlib
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
from kvflow.services.proxy.decode_send import (
    Exchange,
    Held,
    Job,
    ProxyCounters,
    new_job,
    relay_stream,
    send_with_resend,
)
from kvflow.services.proxy.metrics import render_metrics
from kvflow.services.proxy.pairing import InstancePools
from kvflow.services.proxy.resend import ResendPolicy

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def build_app(
    pools: InstancePools,
    timeout_s: float = 600.0,
    secret: ClusterSecret | None = None,
    policy: ResendPolicy | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """`secret` signs the decode requests' kv_transfer_params (needed with KV addresses);
    `transport` replaces the network (tests)."""
    if pools.prefill_kv_addresses and secret is None:
        raise ConfigError(
            "--prefill-kv-address needs the cluster secret (--cluster-secret-file): decode "
            "instances pull KV only from an address the proxy signed"
        )
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), transport=transport)
    counters = ProxyCounters()
    exchange = Exchange(client, pools, secret, policy or ResendPolicy(), counters)

    async def forward(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        counters.requests += 1
        job = new_job(exchange, request.url.path, body, _auth(request))
        return _client_response(job, await send_with_resend(job))

    async def models(request: Request) -> Response:
        return await _first_listing(client, pools, _auth(request))

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "prefill": pools.prefill_urls,
                "decode": pools.decode_urls,
                "requests": counters.requests,
                "prefill_failures": counters.prefill_failures,
                "decode_resends": counters.resends,
                "stream_resumes": counters.stream_resumes,
            }
        )

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(counters), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


def _client_response(job: Job, held: Held) -> Response:
    """The decode side's answer as the client's: whole, or a stream relayed as it comes."""
    headers = {k: v for k, v in held.response.headers.items() if k not in _HOP_HEADERS}
    if held.rest is None:
        return Response(held.first, held.response.status_code, headers)
    return StreamingResponse(
        relay_stream(job, held),
        status_code=held.response.status_code,
        headers=headers,
        background=BackgroundTask(held.response.aclose),
    )


def _auth(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


async def _first_listing(
    client: httpx.AsyncClient, pools: InstancePools, headers: dict[str, str]
) -> Response:
    """/v1/models from the first instance that answers (decode, then prefill): every
    instance serves the same model, and one that is down must not fail the listing."""
    response: httpx.Response | None = None
    for url in [*pools.decode_urls, *pools.prefill_urls]:
        try:
            response = await client.get(url + "/v1/models", headers=headers)
        except httpx.HTTPError:
            continue
        if response.status_code < 500:
            break
    if response is None:
        message = "no instance answers /v1/models"
        return JSONResponse({"error": {"message": message, "code": 503}}, status_code=503)
    return Response(response.content, response.status_code, media_type="application/json")
