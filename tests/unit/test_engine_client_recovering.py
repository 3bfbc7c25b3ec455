"""The frontend's view of a worker recovery: while the scheduler's stats say
`recovering`, the engine is not healthy (why is in the reason) and the requests in
flight are not failed: they resume once the worker is back."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.stats import SchedulerStats
from kvflow.services.frontend.engine_client import EngineClient
from kvflow.services.frontend.metrics import FrontendMetrics


def stats(recovering: str = "", restarts: int = 0, resumed: int = 0) -> SchedulerStats:
    return SchedulerStats(
        timestamp=0.0,
        engine="0",
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        incarnation="s1",
        recovering=recovering,
        num_worker_restarts=restarts,
        num_resumed_requests=resumed,
    )


def test_recovering_is_unhealthy_and_keeps_requests_in_flight(tmp_path: Path) -> None:
    client = EngineClient(ServiceAddresses.ipc(str(tmp_path)), "fe")
    queue: asyncio.Queue[RequestOutputDelta] = asyncio.Queue()
    client._queues["a"] = queue  # a request in flight
    client._owners["a"] = 0
    client._on_stats(stats(), 0)
    assert client.health_problem() is None
    client._on_stats(stats(recovering="worker rank 0 failed: killed"), 0)
    assert client.health_problem() == "recovering: worker rank 0 failed: killed"
    client.check_liveness()
    assert queue.empty() and client.num_in_flight == 1  # not failed: it will resume
    client._on_stats(stats(restarts=1, resumed=1), 0)
    assert client.health_problem() is None


def test_restart_and_resume_counters_are_exported_from_zero() -> None:
    metrics = FrontendMetrics("m", 64)
    metrics.observe_scheduler_stats(stats())
    text = metrics.render().decode()
    assert 'kvflow:worker_restarts_total{engine="0",model_name="m"} 0.0' in text
    metrics.observe_scheduler_stats(stats(restarts=1, resumed=3))
    text = metrics.render().decode()
    assert 'kvflow:worker_restarts_total{engine="0",model_name="m"} 1.0' in text
    assert 'kvflow:requests_resumed_total{engine="0",model_name="m"} 3.0' in text
