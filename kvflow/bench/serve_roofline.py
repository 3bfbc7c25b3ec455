"""The served engine's own step counters over the timed part of `kvflow bench serve`.

A kvflow server counts, per step phase (prefill / decode), its steps, their seconds and
their estimated FLOPs and bytes, and exports its roofs (`/metrics`: kvflow:engine_steps,
engine_step_seconds, estimated_flops, estimated_bytes, device_peak_*; with `kvflow serve
--measure-weight-read` the bandwidth roof is the worker's read pass over its own
weights). Read before and after a run, the differences give what the server's steps
reached during that run alone: the warm-up requests and anything served earlier are
left out. A server without these counters (vLLM) gets no such section.

The scheduler publishes its counters every STATS_INTERVAL_S, so each reading waits
that long first: the last steps of the warm-up (before) and of the run (after) are in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvflow.metrics.roofline import roofline_report
from kvflow.proto.stats import PhaseTotals

STATS_INTERVAL_S = 0.5  # the scheduler's (services/scheduler/loop.py); a reading waits it out
_FIELDS = {
    "kvflow:engine_steps_total": "steps",
    "kvflow:engine_step_seconds_total": "seconds",
    "kvflow:estimated_flops_total": "flops",
    "kvflow:estimated_bytes_total": "bytes",
}


@dataclass(frozen=True)
class StepCounters:
    phases: dict[str, PhaseTotals]  # summed over engines
    peak_flops: float  # 0 = unknown
    peak_bandwidth: float


def read_step_counters(base_url: str, settle: bool = True) -> StepCounters | None:
    """The server's counters now (after one stats interval, with `settle`), or None
    where it exports none."""
    if settle:
        time.sleep(STATS_INTERVAL_S * 1.2)
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return None
    return parse_step_counters(text)


def parse_step_counters(text: str) -> StepCounters | None:
    """The counters in a /metrics page (Prometheus text), or None where it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, dict[str, float]] = {}
    peaks = {"kvflow:device_peak_flops_per_second": 0.0, "kvflow:device_peak_bytes_per_second": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _FIELDS.get(sample.name)
            if field is not None:
                phase = totals.setdefault(sample.labels.get("phase", ""), {})
                phase[field] = phase.get(field, 0.0) + sample.value
            elif sample.name in peaks:
                peaks[sample.name] = max(peaks[sample.name], sample.value)
    if not totals:
        return None
    phases = {
        name: PhaseTotals(int(f.get("steps", 0)), f.get("seconds", 0.0), f.get("flops", 0.0),
                          f.get("bytes", 0.0))
        for name, f in totals.items()
    }  # fmt: skip
    return StepCounters(phases, *peaks.values())


def timed_part(before: StepCounters, after: StepCounters) -> dict[str, Any]:
    """What the steps between the two readings reached: {"phases": roofline_report's
    rows, "peak_flops", "peak_bandwidth"} (the roofs the percentages are of)."""
    deltas = {}
    for name, now in after.phases.items():
        was = before.phases.get(name, PhaseTotals())
        deltas[name] = PhaseTotals(
            now.steps - was.steps, now.seconds - was.seconds, now.flops - was.flops,
            now.bytes - was.bytes,
        )  # fmt: skip
    return {
        "phases": roofline_report(deltas, after.peak_flops, after.peak_bandwidth),
        "peak_flops": after.peak_flops,
        "peak_bandwidth": after.peak_bandwidth,
    }


def timed_part_since(
    before: StepCounters, base_url: str
) -> tuple[dict[str, Any] | None, StepCounters]:
    """(timed_part from `before` to a reading now, that reading); (None, before) when
    the reading fails."""
    after = read_step_counters(base_url)
    return (None, before) if after is None else (timed_part(before, after), after)


def format_timed_part(steps: dict[str, Any]) -> str:
    """The section `kvflow bench serve` prints under its summary."""
    width = 50
    lines = [" Server steps (timed part) ".center(width, "-")]
    lines.append(f"{'Bandwidth roof (GB/s):':<40} {steps['peak_bandwidth'] / 1e9:<10.2f}")
    for phase, row in sorted(steps["phases"].items()):
        lines.append(f"{phase} steps / seconds: {row['steps']} / {row['seconds']:.2f}")
        lines.append(f"  GFLOP/s {row['gflop_per_s']}, GB/s {row['gb_per_s']}")
        compute, bandwidth = row["pct_compute_roofline"], row["pct_bandwidth_roofline"]
        if compute is not None and bandwidth is not None:
            lines.append(f"  % of the compute roof {compute}, of the bandwidth roof {bandwidth}")
    lines.append("=" * width)
    return "\n".join(lines)
