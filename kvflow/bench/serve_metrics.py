"""Serving metrics exactly as `vllm bench serve` defines them, so figures line up.

Per successful request, with times measured by the client (request_client.py):

    sent ──── ttft ────▶ chunk 1 ── itl[0] ──▶ chunk 2 ── … ──▶ last chunk
    └───────────────────────── e2el (latency) ─────────────────────┘

    TTFT = first content chunk - sent
    ITL  = gap between consecutive content chunks (one per chunk, not per token)
    TPOT = (e2el - ttft) / (output_tokens - 1), only for output_tokens > 1
    E2EL = last content chunk - sent

Aggregates: mean / median / std (population, numpy's default) and numpy's linear
percentiles, in milliseconds; an empty list reads as 0 (vLLM's `np.mean(x or 0)`).
Throughputs divide by the benchmark's wall duration. A request is *good* when it meets
every SLO given to `--goodput`; a request of <= 1 output token has TPOT 0 there.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvflow.bench.request_client import RequestOutput

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class MetricStats:
    """One metric's aggregate, in milliseconds; `percentiles` as (p, value) pairs."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
        values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000
        return cls(
            mean=float(np.mean(values)),
            median=float(np.median(values)),
            std=float(np.std(values)),
            percentiles=[(p, float(np.percentile(values, p))) for p in percentiles],
        )


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]  # per request, 0 for failed ones
    stats: dict[str, MetricStats] = field(default_factory=dict)  # by METRIC_NAMES


def parse_slo(pair: str) -> tuple[str, float]:
    """One `--goodput` SLO: "ttft:100" -> ("ttft", 100.0) (milliseconds)."""
    name, sep, value = pair.partition(":")
    try:
        number = float(value) if sep else math.nan
    except ValueError:
        number = math.nan
    if name not in GOODPUT_METRICS or not number >= 0:  # `not >=` also rejects nan
        raise argparse.ArgumentTypeError(
            f"bad SLO {pair!r}: give KEY:MS pairs with KEY one of "
            f"{', '.join(GOODPUT_METRICS)} and MS a non-negative number of milliseconds"
        )
    return name, number


def parse_percentiles(text: str) -> list[float]:
    """`"50,90,99"` -> [50.0, 90.0, 99.0], each in [0, 100]."""
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or not all(0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"bad percentiles {text!r}: numbers in [0, 100]")
    return values


def parse_metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown metrics {unknown}: choose from {METRIC_NAMES}")
    return names


@dataclass
class _Samples:
    """Per-request measurements of the successful requests, in seconds."""

    values: dict[str, list[float]]  # by METRIC_NAMES; itl holds every chunk gap
    all_tpots: list[float]  # one per request, 0 for <= 1 token (for the goodput check)
    output_lens: list[int]  # one per request, 0 for failed ones
    total_input: int


def _collect(outputs: Sequence[RequestOutput], count_tokens: Callable[[str], int]) -> _Samples:
    samples = _Samples({name: [] for name in METRIC_NAMES}, [], [], 0)
    values = samples.values
    for out in outputs:
        if not out.success:
            samples.output_lens.append(0)
            continue
        output_len = out.output_tokens or count_tokens(out.generated_text)
        samples.output_lens.append(output_len)
        samples.total_input += out.prompt_len
        tpot = 0.0
        if output_len > 1:
            tpot = (out.latency - out.ttft) / (output_len - 1)
            values["tpot"].append(tpot)
        samples.all_tpots.append(tpot)
        values["itl"] += out.itl
        values["ttft"].append(out.ttft)
        values["e2el"].append(out.latency)
    return samples


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float],
    goodput: dict[str, float],
    count_tokens: Callable[[str], int],
) -> BenchmarkMetrics:
    """`count_tokens(text)` counts a reply whose server sent no usage (vLLM's fallback)."""
    samples = _collect(outputs, count_tokens)
    values = samples.values
    completed = len(values["ttft"])
    good = _count_good(values["ttft"], samples.all_tpots, values["e2el"], goodput)
    total_input, total_output = samples.total_input, sum(samples.output_lens)
    peak_tokens, peak_requests = _peaks(outputs)
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_requests,
        output_lens=samples.output_lens,
        stats={name: MetricStats.of(values[name], percentiles) for name in METRIC_NAMES},
    )


def _count_good(
    ttfts: list[float], tpots: list[float], e2els: list[float], goodput: dict[str, float]
) -> int:
    """Requests within every given SLO (SLOs in ms, measurements in s)."""
    if not goodput:
        return 0
    columns = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    checks = [(columns[name], limit_ms / 1000) for name, limit_ms in goodput.items()]
    return sum(all(values[i] <= limit for values, limit in checks) for i in range(len(ttfts)))


def _peaks(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """vLLM's peak output rate and peak concurrency over one-second buckets from the
    first request's start: chunks per bucket, and requests active in some part of it."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    buckets = int(np.ceil(max(o.start_time + o.latency for o in done) - t0)) + 1
    chunks = np.zeros(buckets)
    active = np.zeros(buckets)
    for o in done:
        arrivals = o.start_time + o.ttft + np.cumsum([0.0, *o.itl])
        np.add.at(chunks, (arrivals - t0).astype(np.int64).clip(0, buckets - 1), 1)
        first, last = int(o.start_time - t0), int(o.start_time + o.latency - t0)
        active[first : last + 1] += 1
    return float(chunks.max()), int(active.max())


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"
