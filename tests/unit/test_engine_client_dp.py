"""EngineClient with two engines, without sockets: per-engine health, degraded, and a
death that fails only the dead engine's requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvflow.errors import EngineDeadError, InvalidRequestError
from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.engine import AbortRequests, AddRequest
from kvflow.proto.frontend import EngineDead, FrontendOutputs, RequestOutputDelta
from kvflow.proto.stats import SchedulerStats
from kvflow.sampling_params import SamplingParams
from kvflow.services.frontend.engine_client import EngineClient
from kvflow.services.frontend.in_flight import SentRequest


def _client(tmp_path: Path, resend_wait_s: float = 60.0) -> EngineClient:
    addresses = [ServiceAddresses.ipc(str(tmp_path / f"e{i}")) for i in range(2)]
    return EngineClient(addresses, "frontend-x", stats_timeout_s=5.0, resend_wait_s=resend_wait_s)


def _stats(engine: int, incarnation: str, waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(time.time(), str(engine), 0, waiting, 0.0, incarnation=incarnation)


def _in_flight(
    client: EngineClient, child_id: str, engine: int
) -> asyncio.Queue[RequestOutputDelta]:
    queue: asyncio.Queue[RequestOutputDelta] = asyncio.Queue()
    client._queues[child_id] = queue
    client._owners[child_id] = engine
    return queue


def test_one_dead_engine_degrades_and_fails_only_its_requests(tmp_path: Path) -> None:
    client = _client(tmp_path, resend_wait_s=0.0)  # nothing waits for the engine
    assert client.health_problem() is not None  # no stats yet from either
    client._handle(_stats(0, "a"), 0)
    assert client.is_healthy and client.is_degraded  # engine 1 not ready yet
    client._handle(_stats(1, "b"), 1)
    assert client.is_healthy and not client.is_degraded
    on_0, on_1 = _in_flight(client, "r0#0", 0), _in_flight(client, "r1#0", 1)
    client._handle(EngineDead("worker rank 0 failed"), 1)
    assert on_0.empty()
    delta = on_1.get_nowait()
    assert delta.finish_reason == "error" and "(engine 1)" in (delta.error or "")
    assert client.is_healthy and client.is_degraded
    assert client.engine_problems() == {"0": None, "1": "worker rank 0 failed"}
    with pytest.raises(EngineDeadError, match="engine 1"):
        client.check_rank(1)
    with pytest.raises(InvalidRequestError):
        client.check_rank(2)
    # The restarted engine's new incarnation puts it back.
    client._handle(_stats(1, "c"), 1)
    assert client.is_healthy and not client.is_degraded
    client.check_rank(1)


def test_all_engines_down_is_unhealthy_with_every_reason(tmp_path: Path) -> None:
    client = _client(tmp_path)
    client._handle(_stats(0, "a"), 0)
    client._handle(_stats(1, "b"), 1)
    client._handle(EngineDead("boom"), 0)
    client._handle(EngineDead("bang"), 1)
    assert client.health_problem() == "engine 0: boom; engine 1: bang"


def test_a_stats_message_feeds_the_router(tmp_path: Path) -> None:
    client = _client(tmp_path)
    client._handle(_stats(0, "a", waiting=3), 0)
    client._handle(_stats(1, "b"), 1)
    assert client.router.score(0) == 12 and client.router.score(1) == 0
    assert client._route([1, 2, 3], None, None) == 1


class _Inbox:
    """Stands in for an engine's input socket."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


def _sending(client: EngineClient) -> list[_Inbox]:
    inboxes = [_Inbox(), _Inbox()]
    for link, inbox in zip(client.engines, inboxes):
        link.input = inbox  # type: ignore[assignment]
        link.sockets = [inbox]  # type: ignore[list-item]
    return inboxes


def _sent(
    client: EngineClient, child_id: str, engine: int, *, pinned: bool = False, **params: object
) -> asyncio.Queue[RequestOutputDelta]:
    request = AddRequest(child_id, [5, 6, 7], SamplingParams(max_tokens=9, **params), 0.0)  # type: ignore[arg-type]
    client._sent[child_id] = SentRequest(request, pinned=pinned)
    return _in_flight(client, child_id, engine)


def _delta(child_id: str, token_ids: list[int]) -> FrontendOutputs:
    return FrontendOutputs([RequestOutputDelta(child_id, "x", token_ids)])


def test_a_dead_engines_requests_move_with_their_tokens(tmp_path: Path) -> None:
    client = _client(tmp_path)
    inboxes = _sending(client)
    client._handle(_stats(0, "a"), 0)
    client._handle(_stats(1, "b"), 1)
    queue = _sent(client, "r#0", 1, seed=3, prompt_logprobs=2)
    pinned = _sent(client, "p#0", 1, pinned=True)
    client._handle(_delta("r#0", [11, 12]), 1)
    client._handle(_delta("r#0", [13]), 1)
    queue.get_nowait(), queue.get_nowait()
    client._handle(EngineDead("scheduler was killed by SIGKILL"), 1)
    (moved,) = inboxes[0].sent
    assert isinstance(moved, AddRequest) and moved.req_id == "r#0"
    assert moved.prompt_token_ids == [5, 6, 7] and moved.output_token_ids == [11, 12, 13]
    assert moved.sampling_params.seed == 3 and moved.sampling_params.max_tokens == 9
    assert moved.sampling_params.prompt_logprobs is None  # delivered with the first delta
    assert queue.empty() and client._owners["r#0"] == 0  # no error: it goes on elsewhere
    error = pinned.get_nowait()  # data_parallel_rank named the engine that gave up
    assert error.finish_reason == "error" and "(engine 1)" in (error.error or "")
    client._handle(_delta("r#0", [99]), 1)  # a late delta of the engine it left
    assert queue.empty()
    client._handle(_delta("r#0", [14]), 0)
    assert queue.get_nowait().token_ids == [14]


def test_a_pinned_request_waits_for_its_engine_and_goes_on_there(tmp_path: Path) -> None:
    client = _client(tmp_path, resend_wait_s=30.0)
    inboxes = _sending(client)
    client._handle(_stats(0, "a"), 0)
    client._handle(_stats(1, "b"), 1)
    pinned = _sent(client, "p#0", 1, pinned=True)
    client._handle(_delta("p#0", [11]), 1)
    pinned.get_nowait()
    client.engines[1].linked = False  # as _link_loop: its detokenizer went away
    client.fail_engine(1, "lost the connection to the detokenizer", abort=True)
    client.check_liveness()
    (aborted,) = inboxes[1].sent
    assert isinstance(aborted, AbortRequests) and pinned.empty() and inboxes[0].sent == []
    client._handle(FrontendOutputs([RequestOutputDelta("p#0", "", [], "abort")]), 1)
    assert pinned.empty()  # the echo of the frontend's own abort: not the end
    client.engines[1].linked = True  # a detokenizer is back
    client.check_liveness()
    _, resent = inboxes[1].sent
    assert isinstance(resent, AddRequest) and resent.output_token_ids == [11]
    client._handle(_delta("p#0", [12]), 1)
    assert pinned.get_nowait().token_ids == [12]


def test_a_request_held_past_its_wait_ends_with_the_engines_error(tmp_path: Path) -> None:
    client = _client(tmp_path, resend_wait_s=30.0)
    _sending(client)
    client._handle(_stats(0, "a"), 0)
    client._handle(_stats(1, "b"), 1)
    pinned = _sent(client, "p#0", 1, pinned=True)
    client.engines[1].linked = False
    client.fail_engine(1, "lost the connection to the detokenizer", abort=True)
    client.resend_held(time.monotonic() + 29.0)
    assert pinned.empty()
    client.resend_held(time.monotonic() + 31.0)
    error = pinned.get_nowait()
    assert error.finish_reason == "error" and "detokenizer (engine 1)" in (error.error or "")


def test_a_restarted_engines_requests_move_to_another_even_where_it_holds_the_prefix(
    tmp_path: Path,
) -> None:
    """A scheduler restarted before anyone saw it die: its new incarnation's stats abort
    its old requests there, so they must go elsewhere even though the router still
    believes the restarted engine holds their prefix (its abort would end them)."""
    client = _client(tmp_path)
    inboxes = _sending(client)
    client._handle(_stats(0, "a", waiting=5), 0)  # the busier engine, by the router's load
    client._handle(_stats(1, "b"), 1)
    assert client._route([5, 6, 7], None, None) == 1
    queue = _sent(client, "r#0", 1)
    client._handle(_delta("r#0", [11]), 1)
    queue.get_nowait()
    client._handle(_stats(1, "b2"), 1)  # a new incarnation: the scheduler restarted
    aborted, *rest = inboxes[1].sent
    assert isinstance(aborted, AbortRequests) and aborted.req_ids == ["r#0"] and rest == []
    (moved,) = inboxes[0].sent
    assert isinstance(moved, AddRequest) and moved.output_token_ids == [11]
    client._handle(FrontendOutputs([RequestOutputDelta("r#0", "", [], "abort")]), 1)
    assert queue.empty() and client._owners["r#0"] == 0


def test_with_no_engine_left_the_requests_fail(tmp_path: Path) -> None:
    client = _client(tmp_path)
    inboxes = _sending(client)
    client._handle(_stats(0, "a"), 0)
    client._handle(_stats(1, "b"), 1)
    client._handle(EngineDead("gone"), 0)
    queue = _sent(client, "r#0", 1)
    client._handle(EngineDead("also gone"), 1)
    assert queue.get_nowait().finish_reason == "error" and inboxes[0].sent == []


def test_request_series_carry_the_engine_that_sent_the_delta(tmp_path: Path) -> None:
    from kvflow.services.frontend.metrics import FrontendMetrics

    client = _client(tmp_path)
    metrics = FrontendMetrics("m", 64)
    inboxes = _sending(client)
    client._handle(_stats(0, "a"), 0)
    client._handle(_stats(1, "b"), 1)
    queue = _sent(client, "r#0", 1)
    client._handle(FrontendOutputs([RequestOutputDelta("r#0", "x", [3], "length")]), 1)
    tracker = metrics.track_request(time.time())
    delta = queue.get_nowait()
    tracker.observe(delta, time.time(), client.engine_label(delta))
    text = metrics.render().decode()
    line = 'kvflow:request_success_total{engine="1",finished_reason="length",model_name="m"} 1.0'
    assert line in text and inboxes[0].sent == []
