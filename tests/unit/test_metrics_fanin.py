"""Several API servers on one port: a scrape of any of them sums the request-level
series over all of them and shows the engine-level series once (promtool-checked)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from test_perf_metrics import promtool_check

from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.stats import SchedulerStats
from kvflow.services.frontend.metrics import FrontendMetrics
from kvflow.services.frontend.metrics_fanin import STALE_S


def serve(metrics: FrontendMetrics, requests: int) -> None:
    """What one API server counts for `requests` finished requests of 4 tokens."""
    for _ in range(requests):
        metrics.observe_http("/v1/completions", "POST", 200, 0.25)
        tracker = metrics.track_request(time.time() - 1.0)
        tracker.observe(RequestOutputDelta("r", "abcd", [1, 2, 3, 4], "length"), time.time())


def values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault((s.name, tuple(sorted(s.labels.items()))), []).append(s.value)
    return found


def three_api_servers(tmp_path: Path) -> list[FrontendMetrics]:
    servers = [FrontendMetrics("m", 64) for _ in range(3)]
    stats = SchedulerStats(time.time(), "0", 5, 2, 0.5, num_prompt_tokens=100)
    for i, metrics in enumerate(servers):
        metrics.share(tmp_path, f"frontend-{i}")
        metrics.observe_scheduler_stats(stats)  # every API server sees every engine
        serve(metrics, requests=i + 1)
        assert metrics.shared is not None
        metrics.shared.publish()
    return servers


def test_a_scrape_sums_request_series_and_shows_engine_series_once(tmp_path: Path) -> None:
    servers = three_api_servers(tmp_path)
    for metrics in servers:  # whichever process the kernel picks, the same answer
        found = values(metrics.render().decode())
        http = (
            "kvflow:http_requests_total",
            (("method", "POST"), ("route", "/v1/completions"), ("status", "200")),
        )
        assert found[http] == [6.0]  # 1 + 2 + 3
        success = ("kvflow:request_success_total",
                   (("engine", "0"), ("finished_reason", "length"), ("model_name", "m")))  # fmt: skip
        assert found[success] == [6.0]
        tokens = ("kvflow:request_generation_tokens_count", (("engine", "0"), ("model_name", "m")))
        assert found[tokens] == [6.0]
        running = ("kvflow:num_requests_running", (("engine", "0"), ("model_name", "m")))
        assert found[running] == [5.0]  # engine-level: once, not three times
        prompt = ("kvflow:prompt_tokens_total", (("engine", "0"), ("model_name", "m")))
        assert found[prompt] == [100.0]


def test_a_dead_api_servers_share_is_dropped(tmp_path: Path) -> None:
    servers = three_api_servers(tmp_path)
    stale = time.time() - STALE_S - 1
    os.utime(tmp_path / "frontend-2.json", (stale, stale))
    http = (
        "kvflow:http_requests_total",
        (("method", "POST"), ("route", "/v1/completions"), ("status", "200")),
    )
    assert values(servers[0].render().decode())[http] == [3.0]
    assert servers[1].shared is not None
    servers[1].shared.withdraw()
    assert values(servers[0].render().decode())[http] == [1.0]


def test_promtool_accepts_the_summed_scrape(tmp_path: Path) -> None:
    promtool_check(three_api_servers(tmp_path)[0].render().decode())
