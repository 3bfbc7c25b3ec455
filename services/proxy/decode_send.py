"""One client request through prefill and decode, resent while the decode side fails.

    prefill ─▶ decode ─┬─ answer held (whole body, or a stream's first chunk) ─▶ client
        ▲              └─ refused / dropped / 5xx (resend.py) ─ pause ─┐
        └──────────────────────────────────────────────────────────────┘

Each send is a fresh pair: the prompt is prefilled again (its KV may have died with the
decode instance, and the new signature names the prefill instance that holds it now),
and the decode instance is the next in turn, another one than the one that failed when
there are several. When every decode instance refuses connections (down, or restarting),
a prefill instance, itself a whole engine, serves the request as one colocated server
would: slower for the prompts it prefills meanwhile, but an answer. Once the client has bytes of the answer nothing is resent: a stream
that breaks then ends with an error event (see `relay_stream`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvflow.cluster_secret import ClusterSecret
from kvflow.services.proxy.pairing import InstancePools, decode_request, prefill_request
from kvflow.services.proxy.resend import Failure, ResendPolicy, failure_of_error, failure_of_status

logger = logging.getLogger(__name__)


@dataclass
class ProxyCounters:
    requests: int = 0
    prefill_failures: int = 0
    resends: dict[str, int] = field(default_factory=lambda: {f.value: 0 for f in Failure})
    prefill_fallbacks: int = 0  # sends to a prefill instance as a whole request
    gave_up: int = 0  # requests answered with the decode side's failure after the resends
    broken_streams: int = 0  # streams ended by an error event after their first chunk


@dataclass
class Held:
    """A decode instance's answer, held back until it cannot fail any more (a whole
    body) or is the client's to see (a stream's first chunk)."""

    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes] | None  # a stream's chunks after `first`; None: all read


@dataclass
class Exchange:
    """What a request needs for its sends."""

    client: httpx.AsyncClient
    pools: InstancePools
    secret: ClusterSecret | None
    policy: ResendPolicy
    counters: ProxyCounters


@dataclass
class _Tries:
    """One client request's sends so far."""

    first_failure: float | None = None
    failures: int = 0
    resends: int = 0  # dropped or 5xx
    failed_decode: str | None = None
    unreachable: set[str] = field(default_factory=set)  # decode URLs refused since a fallback


async def send_with_resend(
    ex: Exchange, path: str, body: dict[str, Any], headers: dict[str, str]
) -> Held:
    """The decode side's answer to hold; after the last allowed failure, that failure's
    answer (its 5xx as is; a 502/503 when no instance answered)."""
    tries = _Tries()
    while True:
        prefill_url, kv_address, decode_url = ex.pools.pick(avoid_decode=tries.failed_decode)
        fallback = ex.policy.prefill_fallback and tries.unreachable >= set(ex.pools.decode_urls)
        if fallback:  # no decode instance takes connections: a prefill instance serves it
            ex.counters.prefill_fallbacks += 1
            tries.unreachable.clear()
            target, request = prefill_url, decode_request(body, "", None, 0.0)
        else:
            await _prefill(ex, prefill_url + path, body, headers)
            target, request = decode_url, decode_request(body, kv_address, ex.secret, time.time())
        held: Held | None = None
        try:
            held = await _send(ex.client, target + path, request, headers, body)
            failure = failure_of_status(held.response.status_code)
            reason = f"answered {held.response.status_code}"
        except httpx.HTTPError as exc:
            failure, reason = failure_of_error(exc), f"{type(exc).__name__}: {exc}"
            if failure is None:
                raise
        if failure is None:
            assert held is not None  # (an error that is no failure was raised above)
            return held
        now = time.monotonic()
        tries.first_failure = now if tries.first_failure is None else tries.first_failure
        tries.failures += 1
        tries.resends += failure is not Failure.UNREACHABLE
        waited = now - tries.first_failure
        pause = ex.policy.delay(failure, tries.failures, tries.resends, waited)
        if pause is None:
            ex.counters.gave_up += 1
            logger.warning("%s %s: giving up after %d failures", target, reason, tries.failures)
            return held if held is not None else _gave_up(failure, reason, waited)
        if held is not None:
            await held.response.aclose()
        ex.counters.resends[failure.value] += 1
        if not fallback:
            tries.failed_decode = decode_url
            if failure is Failure.UNREACHABLE:
                tries.unreachable.add(decode_url)
        logger.warning("%s %s: resending in %.2f s", target, reason, pause)
        await asyncio.sleep(pause)


async def _send(
    client: httpx.AsyncClient,
    url: str,
    request: dict[str, Any],
    headers: dict[str, str],
    body: dict[str, Any],
) -> Held:
    response = await client.send(
        client.build_request("POST", url, json=request, headers=headers), stream=True
    )
    try:
        if not body.get("stream") or response.status_code != 200:
            return Held(response, await response.aread(), None)
        chunks = response.aiter_raw()
        first = b""
        async for first in chunks:
            if first:
                break
        return Held(response, first, chunks)
    except BaseException:
        await response.aclose()
        raise


async def relay_stream(held: Held, counters: ProxyCounters) -> AsyncIterator[bytes]:
    """A held stream to the client. If the decode instance dies after the first chunk,
    the stream ends with an OpenAI error event and [DONE]: the client has text the
    proxy cannot resume from (see docs/deployment.md, "Disaggregated prefill and decode")."""
    yield held.first
    if held.rest is None:
        return
    try:
        async for chunk in held.rest:
            yield chunk
    except httpx.HTTPError as exc:
        counters.broken_streams += 1
        logger.warning("decode stream broke after its first chunk: %s", exc)
        message = f"the decode instance failed during the stream ({type(exc).__name__})"
        error = {"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}
        yield b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


async def _prefill(ex: Exchange, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    try:
        response = await ex.client.post(url, json=prefill_request(body), headers=headers)
    except httpx.HTTPError as exc:
        ex.counters.prefill_failures += 1
        logger.warning("prefill at %s failed (%s): decode computes the prompt", url, exc)
        return
    if response.status_code != 200:
        ex.counters.prefill_failures += 1
        logger.warning(
            "prefill at %s answered %d: decode computes the prompt", url, response.status_code
        )


def _gave_up(failure: Failure, reason: str, waited_s: float) -> Held:
    """The answer when no decode instance took the request: 503 when none was reachable
    (the client may retry later), else 502 (instances took it and failed)."""
    status = 503 if failure is Failure.UNREACHABLE else 502
    message = f"no instance completed the request within {waited_s:.0f} s ({reason})"
    error = {"error": {"message": message, "type": "ServiceUnavailableError", "code": status}}
    response = httpx.Response(status, headers={"content-type": "application/json"})
    return Held(response, json.dumps(error).encode(), None)
