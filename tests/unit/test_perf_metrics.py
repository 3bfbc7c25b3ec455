"""Roofline counters, device peaks and start-up phases on the frontend's /metrics."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.proto.stats import PhaseTotals, SchedulerStats
from kvflow.services.frontend.metrics import FrontendMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
PHASES = {"model_resolve": 0.25, "model_load": 1.5, "kv_cache_allocate": 0.125}


def stats(prefill: PhaseTotals, decode: PhaseTotals, engine: str = "0") -> SchedulerStats:
    return SchedulerStats(
        1.0,
        engine,
        0,
        0,
        0.0,
        roofline={"prefill": prefill, "decode": decode},
        peak_flops=2e12,
        peak_bandwidth=5e10,
        startup_phases=PHASES,
    )


def samples(metrics: FrontendMetrics) -> Samples:
    text = metrics.render().decode()
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def at(values: Samples, name: str, **labels: str) -> float:
    return values[(name, frozenset({"engine": "0", **labels}.items()))]


def test_counters_follow_the_cumulative_totals() -> None:
    metrics = FrontendMetrics("m", 64)
    metrics.observe_scheduler_stats(stats(PhaseTotals(2, 0.5, 4e9, 1e8), PhaseTotals()))
    metrics.observe_scheduler_stats(
        stats(PhaseTotals(3, 0.75, 6e9, 1.5e8), PhaseTotals(10, 0.25, 1e9, 2.5e9))
    )
    values = samples(metrics)
    assert at(values, "kvflow:estimated_flops_total", phase="prefill") == 6e9
    assert at(values, "kvflow:estimated_bytes_total", phase="prefill") == 1.5e8
    assert at(values, "kvflow:engine_step_seconds_total", phase="prefill") == 0.75
    assert at(values, "kvflow:engine_steps_total", phase="prefill") == 3
    assert at(values, "kvflow:estimated_bytes_total", phase="decode") == 2.5e9
    assert at(values, "kvflow:device_peak_flops_per_second") == 2e12
    assert at(values, "kvflow:device_peak_bytes_per_second") == 5e10
    for phase, seconds in PHASES.items():
        assert at(values, "kvflow:startup_phase_seconds", phase=phase) == seconds
    # A restarted engine starts from zero: its new total is the increment.
    metrics.observe_scheduler_stats(stats(PhaseTotals(1, 0.1, 1e9, 1e7), PhaseTotals()))
    assert at(samples(metrics), "kvflow:estimated_flops_total", phase="prefill") == 7e9


def test_unknown_peaks_are_not_exported() -> None:
    metrics = FrontendMetrics("m", 64)
    metrics.observe_scheduler_stats(SchedulerStats(1.0, "0", 0, 0, 0.0))
    names = {name for name, _ in samples(metrics)}
    assert "kvflow:device_peak_flops_per_second" not in names
    assert "kvflow:startup_phase_seconds" not in names


def test_engine_counters_exist_before_they_count() -> None:
    metrics = FrontendMetrics("m", 64)
    metrics.observe_scheduler_stats(SchedulerStats(1.0, "0", 0, 0, 0.0))
    values = samples(metrics)
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions"):
        assert at(values, f"kvflow:{name}_total") == 0.0


def promtool_check(text: str) -> None:
    """promtool's `check metrics` finds nothing but the two names kvflow keeps (the
    `kvflow:` colon and vLLM's histogram name); skipped without promtool unless
    KVFLOW_REQUIRE_PROMTOOL=1."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("KVFLOW_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required but not installed (Debian package 'prometheus')")
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    unexpected = [
        p
        for p in problems
        if not p.endswith("metric names should not contain ':'")
        and not p.startswith("kvflow:iteration_tokens_total ")
    ]
    assert unexpected == []
    assert result.returncode in (0, 3), result


def test_promtool_accepts_them() -> None:
    metrics = FrontendMetrics("m", 64)
    metrics.observe_scheduler_stats(stats(PhaseTotals(2, 0.5, 4e9, 1e8), PhaseTotals()))
    text = metrics.render().decode()
    assert "kvflow:estimated_flops_total{" in text
    promtool_check(text)


def test_encoder_cache_counters_follow_the_engine_totals() -> None:
    metrics = FrontendMetrics("m", 64)
    metrics.observe_scheduler_stats(SchedulerStats(1.0, "0", 0, 0, 0.0))
    assert at(samples(metrics), "kvflow:mm_encoder_cache_hits_total") == 0.0
    for queries, hits in ((1, 0), (3, 1)):
        metrics.observe_scheduler_stats(
            SchedulerStats(
                1.0, "0", 0, 0, 0.0, mm_encoder_cache_queries=queries, mm_encoder_cache_hits=hits
            )
        )
    values = samples(metrics)
    assert at(values, "kvflow:mm_encoder_cache_queries_total") == 3
    assert at(values, "kvflow:mm_encoder_cache_hits_total") == 1
