"""The frontend's engine client and its connection to the detokenizer, over real ipc
sockets: when that connection drops (the detokenizer died or restarts) the requests in
flight are aborted, and the client is not ready until it is back. A restarted
detokenizer has no state for the old requests and drops their deltas, so the requests
are held and sent again with their tokens so far once it is back (or, with no wait
allowed, end with an error at once): without this their streams would never end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.engine import AbortRequests, AddRequest
from kvflow.proto.frontend import FrontendOutputs, RequestOutputDelta
from kvflow.proto.stats import SchedulerStats
from kvflow.sampling_params import SamplingParams
from kvflow.services.frontend.engine_client import EngineClient

NOT_LINKED = "waiting for the engine: not connected to the detokenizer"


class Peers:
    """The scheduler's stats and input sockets and the detokenizer's ROUTER, bound."""

    def __init__(self, context: zmq.asyncio.Context, addresses: ServiceAddresses) -> None:
        self.context = context
        self.addresses = addresses
        self.stats = context.socket(zmq.PUB)
        self.stats.bind(addresses.stats)
        self.inputs = context.socket(zmq.PULL)
        self.inputs.bind(addresses.scheduler_input)
        self.router = self.bind_router()

    def bind_router(self) -> zmq.asyncio.Socket:
        router = self.context.socket(zmq.ROUTER)
        router.bind(self.addresses.frontend_output)
        return router

    def publish_stats(self) -> None:
        stats = SchedulerStats(time.time(), "0", 0, 0, 0.0, incarnation="one")
        self.stats.send(msgspec.msgpack.encode(stats))

    async def received(self) -> AddRequest | AbortRequests:
        payload = await asyncio.wait_for(self.inputs.recv(), 5.0)
        return msgspec.msgpack.decode(payload, type=AddRequest | AbortRequests)

    def close(self) -> None:
        for sock in (self.stats, self.inputs, self.router):
            sock.close(linger=0)


async def _until(predicate: Callable[[], bool], peers: Peers, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        peers.publish_stats()  # a PUB drops what it sends before the SUB is connected
        await asyncio.sleep(0.02)


async def _scenario(addresses: ServiceAddresses, resend_wait_s: float) -> None:
    context = zmq.asyncio.Context()
    peers = Peers(context, addresses)
    client = EngineClient(addresses, "frontend-x", resend_wait_s=resend_wait_s)
    await client.start()
    try:
        await _until(lambda: client.is_healthy, peers)

        async def consume() -> list[RequestOutputDelta]:
            params = SamplingParams(max_tokens=4)
            return [delta async for delta in client.generate("req-1", [1, 2, 3], params)]

        request = asyncio.create_task(consume())
        assert isinstance(await peers.received(), AddRequest)
        await _answer(peers, [7], None)
        peers.router.close(linger=0)  # the detokenizer dies
        abort = await peers.received()
        assert isinstance(abort, AbortRequests) and abort.req_ids == ["req-1"]
        if resend_wait_s == 0:  # no waiting: the request ends at once
            deltas = await asyncio.wait_for(request, 5.0)
            assert [(d.req_id, d.finish_reason) for d in deltas[1:]] == [("req-1", "error")]
            assert "lost the connection to the detokenizer" in (deltas[1].error or "")
        peers.publish_stats()
        assert client.health_problem() == NOT_LINKED

        peers.router = peers.bind_router()  # a new detokenizer on the same address
        await _until(lambda: client.is_healthy, peers)
        if resend_wait_s > 0:  # held, and resent with its token so far once it is back
            resent = await peers.received()
            assert isinstance(resent, AddRequest) and resent.output_token_ids == [7]
            await _answer(peers, [8, 9, 10], "length")
            deltas = await asyncio.wait_for(request, 5.0)
            assert [d.token_ids for d in deltas] == [[7], [8, 9, 10]]
            assert deltas[-1].finish_reason == "length"
    finally:
        await client.close()
        peers.close()
        context.term()


async def _answer(peers: Peers, token_ids: list[int], finish_reason: str | None) -> None:
    """The detokenizer's delta for req-1, sent until the frontend's DEALER is there."""
    delta = RequestOutputDelta("req-1", "x", token_ids, finish_reason=finish_reason)
    payload = msgspec.msgpack.encode(FrontendOutputs([delta]))
    await peers.router.send_multipart([b"frontend-x", payload])


@pytest.mark.parametrize("resend_wait_s", [60.0, 0.0])
def test_a_lost_detokenizer_holds_requests_in_flight_until_it_is_back(
    tmp_path: Path, resend_wait_s: float
) -> None:
    asyncio.run(_scenario(ServiceAddresses.ipc(str(tmp_path)), resend_wait_s))


def test_a_client_without_sockets_does_not_wait_for_the_detokenizer(tmp_path: Path) -> None:
    client = EngineClient(ServiceAddresses.ipc(str(tmp_path)), "frontend-x")
    client._handle(SchedulerStats(time.time(), "0", 0, 0, 0.0, incarnation="one"))
    assert client.is_healthy
