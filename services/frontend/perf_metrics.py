"""Prometheus metrics of how the engine uses the hardware, from `SchedulerStats`:

    kvflow:estimated_flops_total{phase}      estimated FLOPs of the engine steps
    kvflow:estimated_bytes_total{phase}      estimated bytes moved to/from device memory
    kvflow:engine_step_seconds_total{phase}  time in steps (plan sent -> result back)
    kvflow:engine_steps_total{phase}         steps
    kvflow:device_peak_flops_per_second      the roofs the worker resolved (calibrated on
    kvflow:device_peak_bytes_per_second      CPU, a table on GPUs, or --peak-* flags)
    kvflow:startup_phase_seconds{phase}      seconds of each start-up phase

`phase` of the step metrics is "prefill" or "decode" (the majority of a step's tokens;
see kvflow/metrics/roofline.py). % of roofline over the last minute, per phase:

    rate(kvflow:estimated_flops_total[1m]) / rate(kvflow:engine_step_seconds_total[1m])
      / kvflow:device_peak_flops_per_second
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvflow.proto.stats import SchedulerStats

# (engine, cumulative field key, value) -> increment since the last value seen.
Increment = Callable[[str, str, float], float]


class PerfMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "engine"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvflow:{name}", doc, [*labels, "phase"], registry=registry)

        def gauge(name: str, doc: str, extra: list[str]) -> Gauge:
            return Gauge(f"kvflow:{name}", doc, labels + extra, registry=registry)

        self.flops = counter("estimated_flops", "Estimated FLOPs of engine steps.")
        self.bytes = counter(
            "estimated_bytes", "Estimated bytes moved to and from device memory by engine steps."
        )
        self.step_seconds = counter(
            "engine_step_seconds", "Time in engine steps, from plan sent to result received."
        )
        self.steps = counter("engine_steps", "Number of engine steps.")
        self.peak_flops = gauge(
            "device_peak_flops_per_second", "Peak FLOP/s of the device at the dtype in use.", []
        )
        self.peak_bandwidth = gauge(
            "device_peak_bytes_per_second", "Peak memory bandwidth of the device in bytes/s.", []
        )
        self.startup = gauge(
            "startup_phase_seconds", "Seconds taken by each start-up phase.", ["phase"]
        )

    def observe(self, stats: SchedulerStats, increment: Increment) -> None:
        labels = (self.model_name, stats.engine)
        for phase, totals in stats.roofline.items():
            for metric, field, value in (
                (self.flops, "flops", totals.flops),
                (self.bytes, "bytes", totals.bytes),
                (self.step_seconds, "seconds", totals.seconds),
                (self.steps, "steps", totals.steps),
            ):
                delta = increment(stats.engine, f"roofline.{phase}.{field}", value)
                if delta:
                    metric.labels(*labels, phase).inc(delta)
        if stats.peak_flops > 0:
            self.peak_flops.labels(*labels).set(stats.peak_flops)
        if stats.peak_bandwidth > 0:
            self.peak_bandwidth.labels(*labels).set(stats.peak_bandwidth)
        for phase, seconds in stats.startup_phases.items():
            self.startup.labels(*labels, phase).set(seconds)
