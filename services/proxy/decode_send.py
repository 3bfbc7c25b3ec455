"""One client request through prefill and decode, resent while the decode side fails.

    prefill ─▶ decode ─┬─ answer held (whole body, or a stream's first chunk) ─▶ client
        ▲              └─ refused / dropped / 5xx (resend.py) ─ pause ─┐
        └──────────────────────────────────────────────────────────────┘

Each send is a fresh pair: the prompt is prefilled again (its KV may have died with the
decode instance, and the new signature names the prefill instance that holds it now),
and the decode instance is the next in turn, another one than the one that failed when
there are several. When every decode instance refuses connections (down, or restarting),
a prefill instance, itself a whole engine, serves the request as one colocated server
would: slower for the prompts it prefills meanwhile, but an answer.

Once the client has bytes of the answer, a stream that breaks is resumed rather than
resent: the next decode instance continues each choice from the tokens the client has
(resume.py, `relay_stream`), within the same budget of resends. Only a stream that
cannot be resumed (a beam search, or no cluster secret to sign its tokens) ends with an
error event.
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
from kvflow.services.proxy.resume import StreamRecord, num_choices, resumable

logger = logging.getLogger(__name__)


class StreamFailedError(Exception):
    """A decode stream's own 5xx error event (resume.py): resumed like a dropped one."""


@dataclass
class ProxyCounters:
    requests: int = 0
    prefill_failures: int = 0
    resends: dict[str, int] = field(default_factory=lambda: {f.value: 0 for f in Failure})
    prefill_fallbacks: int = 0  # sends to a prefill instance as a whole request
    gave_up: int = 0  # requests answered with the decode side's failure after the resends
    broken_streams: int = 0  # streams ended by an error event after their first chunk
    stream_resumes: int = 0  # streams that broke after their first chunk and went on


@dataclass
class Held:
    """A decode instance's answer, held back until it cannot fail any more (a whole
    body) or is the client's to see (a stream's first chunk)."""

    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes] | None  # a stream's chunks after `first`; None: all read
    url: str = ""  # the instance that answered a stream


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
    """One client request's sends so far (its stream's resumes included)."""

    first_failure: float | None = None
    failures: int = 0
    resends: int = 0  # dropped or 5xx
    waited_s: float = 0.0  # since the first failure, as of the last one
    failed_decode: str | None = None
    unreachable: set[str] = field(default_factory=set)  # decode URLs refused since a fallback

    def failed(self, ex: Exchange, failure: Failure, target: str, reason: str) -> float | None:
        """Count a failure: the pause before the next send, or None to give up."""
        now = time.monotonic()
        self.first_failure = now if self.first_failure is None else self.first_failure
        self.failures += 1
        self.resends += failure is not Failure.UNREACHABLE
        self.waited_s = now - self.first_failure
        pause = ex.policy.delay(failure, self.failures, self.resends, self.waited_s)
        if pause is None:
            ex.counters.gave_up += 1
            logger.warning("%s %s: giving up after %d failures", target, reason, self.failures)
            return None
        ex.counters.resends[failure.value] += 1
        logger.warning("%s %s: resending in %.2f s", target, reason, pause)
        return pause


@dataclass
class Job:
    """One client request through the proxy."""

    ex: Exchange
    path: str
    body: dict[str, Any]  # as the client sent it
    headers: dict[str, str]
    record: StreamRecord | None = None  # a stream that can be resumed: what it sent
    tries: _Tries = field(default_factory=_Tries)


def new_job(ex: Exchange, path: str, body: dict[str, Any], headers: dict[str, str]) -> Job:
    wants_ids = bool(body.get("return_token_ids"))
    record = StreamRecord(wants_ids, num_choices(body)) if resumable(body, ex.secret) else None
    return Job(ex, path, body, headers, record)


async def send_with_resend(job: Job, resume: list[dict[str, Any]] | None = None) -> Held:
    """The decode side's answer to hold; after the last allowed failure, that failure's
    answer (its 5xx as is; a 502/503 when no instance answered). `resume`: a broken
    stream's choices so far, which the decode instance continues from."""
    ex, tries = job.ex, job.tries
    body = job.body if job.record is None else {**job.body, "return_token_ids": True}
    while True:
        prefill_url, kv_address, decode_url = ex.pools.pick(avoid_decode=tries.failed_decode)
        fallback = ex.policy.prefill_fallback and tries.unreachable >= set(ex.pools.decode_urls)
        if fallback:  # no decode instance takes connections: a prefill instance serves it
            ex.counters.prefill_fallbacks += 1
            tries.unreachable.clear()
            target, kv_address = prefill_url, ""
        else:
            await _prefill(ex, prefill_url + job.path, body, job.headers)
            target = decode_url
        request = decode_request(body, kv_address, ex.secret, time.time(), resume)
        held: Held | None = None
        try:
            held = await _send(ex.client, target, job.path, request, job.headers)
            failure = failure_of_status(held.response.status_code)
            reason = f"answered {held.response.status_code}"
        except httpx.HTTPError as exc:
            failure, reason = failure_of_error(exc), f"{type(exc).__name__}: {exc}"
            if failure is None:
                raise
        if failure is None:
            assert held is not None  # (an error that is no failure was raised above)
            return held
        pause = tries.failed(ex, failure, target, reason)
        if pause is None:
            return held if held is not None else _gave_up(failure, reason, tries.waited_s)
        if held is not None:
            await held.response.aclose()
        if not fallback:
            tries.failed_decode = decode_url
            if failure is Failure.UNREACHABLE:
                tries.unreachable.add(decode_url)
        await asyncio.sleep(pause)


async def _send(
    client: httpx.AsyncClient,
    base_url: str,
    path: str,
    request: dict[str, Any],
    headers: dict[str, str],
) -> Held:
    response = await client.send(
        client.build_request("POST", base_url + path, json=request, headers=headers),
        stream=True,
    )
    try:
        if not request.get("stream") or response.status_code != 200:
            return Held(response, await response.aread(), None)
        chunks = response.aiter_raw()
        first = b""
        async for first in chunks:
            if first:
                break
        return Held(response, first, chunks, base_url)
    except BaseException:
        await response.aclose()
        raise


async def relay_stream(job: Job, held: Held) -> AsyncIterator[bytes]:
    """A held stream to the client. If the decode instance dies after the first chunk
    (the connection drops, or its own 5xx error event ends the stream), the stream goes
    on from another decode instance (or the same one, restarted) with each choice's
    tokens so far (resume.py), within the request's resend budget; the client sees one
    stream. Past the budget, or for a stream that cannot be resumed (a beam search, no
    cluster secret), it ends with an OpenAI error event and [DONE]."""
    record = job.record
    try:
        while True:
            try:
                async for chunk in _chunks(held):
                    yield chunk if record is None else record.relay(chunk)
                    if record is not None and record.failed is not None:
                        raise StreamFailedError(record.failed)
                return
            except (httpx.HTTPError, StreamFailedError) as exc:
                if record is not None and record.done:
                    yield b"data: [DONE]\n\n"  # the answer is whole; only its end was lost
                    return
                logger.warning("decode stream at %s broke after its first chunk: %s",
                               held.url, exc)  # fmt: skip
                await held.response.aclose()
                held = await _resumed(job, held, exc)
            if held.rest is None:
                job.ex.counters.broken_streams += 1
                yield _error_event(held)
                return
            job.ex.counters.stream_resumes += 1
    finally:
        await held.response.aclose()


async def _chunks(held: Held) -> AsyncIterator[bytes]:
    yield held.first
    if held.rest is not None:
        async for chunk in held.rest:
            yield chunk


async def _resumed(job: Job, broken: Held, exc: Exception) -> Held:
    """A new stream that continues the broken one; or, where none can, an answer with
    no stream (rest None) whose body says why."""
    if isinstance(exc, StreamFailedError):
        failure: Failure | None = Failure.STATUS
        reason = f"the decode instance failed during the stream: {exc}"
    else:
        assert isinstance(exc, httpx.HTTPError)
        failure = failure_of_error(exc)
        reason = f"the decode instance failed during the stream ({type(exc).__name__})"
    if job.record is None or failure not in (Failure.DROPPED, Failure.STATUS):
        return _failed(reason)
    pause = job.tries.failed(job.ex, failure, broken.url, reason)
    if pause is None:
        return _failed(reason)
    job.tries.failed_decode = broken.url
    resume = job.record.broke()
    await asyncio.sleep(pause)
    held = await send_with_resend(job, resume=resume)
    if held.rest is None:
        await held.response.aclose()
        logger.warning("resuming the stream: %d %s", held.response.status_code, held.first[:200])
        return _failed(f"{reason}; resuming it failed ({held.response.status_code})")
    return held


def _failed(message: str) -> Held:
    error = {"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}
    return Held(httpx.Response(503), json.dumps(error).encode(), None)


def _error_event(held: Held) -> bytes:
    return b"data: " + held.first + b"\n\ndata: [DONE]\n\n"


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
