"""Request-level Prometheus metrics: vLLM's per-request histograms under `kvflow:`.

Fed by each request's deltas (`RequestTracker`): TTFT, inter-token latency, decode time
and e2e latency from the frontend's clock; queue and prefill time from the engine's
timestamps (all wall-clock `time.time()`, so the clocks agree on one host).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvflow.proto.frontend import RequestOutputDelta

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
TTFT_BUCKETS += [5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75]
TOKEN_LATENCY_BUCKETS += [1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0]
REQUEST_LATENCY_BUCKETS += [40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


class RequestMetrics:
    """The request-level metrics, labelled (model_name, engine) and registered in
    `registry`."""

    def __init__(self, registry: CollectorRegistry, labels: list[str], max_model_len: int) -> None:
        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"kvflow:{name}", doc, labels, buckets=buckets, registry=registry)

        self.request_success = Counter(
            "kvflow:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self._define_phase_metrics(histogram)

    def _define_phase_metrics(
        self, histogram: Callable[[str, str, list[float]], Histogram]
    ) -> None:
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        phase = "Histogram of time spent in {} phase for request."
        self.queue_time = histogram(
            "request_queue_time_seconds", phase.format("WAITING"), REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", phase.format("PREFILL"), REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", phase.format("DECODE"), REQUEST_LATENCY_BUCKETS
        )


class RequestSeries:
    """The request-level series of one (model_name, engine), bound once: a `labels()`
    lookup per token would cost more than the observation itself."""

    def __init__(self, metrics: RequestMetrics, model_name: str, engine: str) -> None:
        labels = (model_name, engine)
        self.ttft = metrics.ttft.labels(*labels)
        self.itl = metrics.itl.labels(*labels)
        self.tpot = metrics.tpot.labels(*labels)
        self.e2e = metrics.e2e.labels(*labels)
        self.queue_time = metrics.queue_time.labels(*labels)
        self.prefill_time = metrics.prefill_time.labels(*labels)
        self.decode_time = metrics.decode_time.labels(*labels)
        self.prompt_tokens = metrics.request_prompt_tokens.labels(*labels)
        self.generation_tokens = metrics.request_generation_tokens.labels(*labels)
        self.success = {r: metrics.request_success.labels(*labels, r) for r in FINISHED_REASONS}


class RequestTracker:
    """Timings of one sample (one engine request) from its deltas.

        arrival ── queued ── scheduled ── first token ──── ... ──── finished
          │ (frontend)  queue │  prefill  │   decode (ITL per token)   │
          └────────────── TTFT ───────────┘                            │
          └───────────────────────────── e2e ──────────────────────────┘

    Observes once, when the sample finishes (`observe` with a finish reason) or is
    abandoned because the client left (`abandon`, counted as finished_reason="abort").
    A sample the engine failed (finish reason "error") is not a finished request.
    """

    def __init__(
        self, series_of: Callable[[str | None], RequestSeries], arrival_time: float
    ) -> None:
        self.series_of = series_of  # engine label (None: the default one) -> its series
        self.series = series_of(None)
        self.arrival_time = arrival_time
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.num_prompt_tokens = 0
        self.queued_time = self.scheduled_time = self.engine_first_token_time = 0.0
        self.done = False

    def observe(self, delta: RequestOutputDelta, now: float, engine: str | None = None) -> None:
        """`engine`: the label of the engine that sent the delta (None: the default);
        a request re-routed after its engine died counts under the one that ends it."""
        if self.done:
            return
        if engine is not None:
            self.series = self.series_of(engine)
        if delta.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                self.series.ttft.observe(now - self.arrival_time)
            elif self.last_token_at is not None:
                gap = (now - self.last_token_at) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.series.itl.observe(gap)
            self.last_token_at = now
        counted = self.num_output_tokens + len(delta.token_ids)
        self.num_output_tokens = max(counted, delta.num_output_tokens)
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        if delta.queued_time:
            self.queued_time = delta.queued_time
            self.scheduled_time = delta.scheduled_time
            self.engine_first_token_time = delta.first_token_time
        if delta.finish_reason in FINISHED_REASONS:
            self._finish(delta.finish_reason, now)
        elif delta.finish_reason is not None:
            self.done = True

    def abandon(self, now: float) -> None:
        if not self.done:
            self._finish("abort", now)

    def _finish(self, reason: str, now: float) -> None:
        self.done = True
        series = self.series
        series.success[reason].inc()
        series.e2e.observe(now - self.arrival_time)
        series.prompt_tokens.observe(self.num_prompt_tokens)
        series.generation_tokens.observe(self.num_output_tokens)
        if self.scheduled_time >= self.queued_time > 0.0:
            series.queue_time.observe(self.scheduled_time - self.queued_time)
        if self.engine_first_token_time >= self.scheduled_time > 0.0:
            series.prefill_time.observe(self.engine_first_token_time - self.scheduled_time)
        if self.first_token_at is not None and self.last_token_at is not None:
            decode = self.last_token_at - self.first_token_at
            series.decode_time.observe(decode)
            if self.num_output_tokens > 1:
                series.tpot.observe(decode / (self.num_output_tokens - 1))
