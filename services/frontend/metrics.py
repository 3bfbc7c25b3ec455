"""Prometheus metrics of the frontend: vLLM's names and definitions under `kvflow:`.

Dashboards and alerts written for vLLM port over by replacing `vllm:` with `kvflow:`;
every engine metric has the labels `model_name` and `engine`. Three sources feed them:

- `SchedulerStats` (about every 0.5 s per engine): gauges are set; the message's
  cumulative counters are turned into increments against the last value seen from that
  engine (a value below the last one means the engine restarted: the new value is
  then the increment), so exported counters never go backwards;
- each request's deltas (`RequestTracker`, request_metrics.py);
- the HTTP middleware: request count by route and status, and duration by route;
- the serving code: requests refused or ended for load or time, by reason.

A private CollectorRegistry keeps several apps in one process (tests) apart.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvflow.proto.kv_transfer import KVTransferStats
from kvflow.proto.lora import LoRARequest
from kvflow.proto.stats import GrammarStats, SchedulerStats
from kvflow.runtime.cluster_auth import REFUSALS
from kvflow.services.frontend.lora_metrics import LoRAMetrics
from kvflow.services.frontend.metrics_fanin import SharedProcessMetrics
from kvflow.services.frontend.perf_metrics import PerfMetrics
from kvflow.services.frontend.request_metrics import RequestMetrics, RequestSeries, RequestTracker

KV_TRANSFER_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
KV_TRANSFER_BUCKETS += [2.5, 5.0, 10.0, 30.0]
# KVTransferStats cumulative field -> (counter name, help).
_KV_TRANSFER_COUNTERS = {
    "num_loaded_requests": (
        "kv_transfer_loaded_requests",
        "Requests that loaded KV from a connector.",
    ),
    "num_loaded_tokens": (
        "kv_transfer_loaded_tokens",
        "Prompt tokens whose KV was loaded, not computed.",
    ),
    "num_saved_blocks": ("kv_transfer_saved_blocks", "KV blocks saved by a producer."),
    "bytes_loaded": ("kv_transfer_loaded_bytes", "KV bytes loaded through the connector."),
    "bytes_saved": ("kv_transfer_saved_bytes", "KV bytes saved through the connector."),
    "num_load_failures": ("kv_load_failures", "KV loads that failed."),
    "num_computed_prompt_tokens": (
        "kv_transfer_computed_prompt_tokens",
        "Prompt tokens this engine computed itself (with a KV connector).",
    ),
}
GRAMMAR_COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# kvflow:requests_rejected reasons: the codes of QueueFullError, QueueTimeoutError and
# RequestTimeoutError (kvflow/errors.py).
REJECTION_REASONS = ("queue_full", "queue_timeout", "timeout")
CONTENT_TYPE = CONTENT_TYPE_LATEST

# SchedulerStats cumulative field -> counter attribute of EngineMetrics.
_CUMULATIVE = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "num_prompt_tokens": "prompt_tokens",
    "num_generation_tokens": "generation_tokens",
    "num_worker_restarts": "worker_restarts",
    "num_resumed_requests": "requests_resumed",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "mm_encoder_cache_queries": "mm_encoder_cache_queries",
    "mm_encoder_cache_hits": "mm_encoder_cache_hits",
}


class FrontendMetrics:
    def __init__(self, model_name: str, max_model_len: int, default_engine: str = "0") -> None:
        self.model_name = model_name
        # The engine label of request-level metrics with one engine (with several, the
        # label of the engine that served the request: EngineClient.engine_label).
        self.default_engine = default_engine
        # Engine-level families (from the engines' stats: alike in every API server) and
        # this process's own (its requests): summed over API servers when shared.
        self.registry = CollectorRegistry(auto_describe=True)
        self.process_registry = CollectorRegistry(auto_describe=True)
        self.shared: SharedProcessMetrics | None = None
        self._last_cumulative: dict[tuple[str, str], float] = {}
        labels = ["model_name", "engine"]
        self._define_engine_metrics(labels)
        self._define_media_metrics(labels)
        self._define_grammar_metrics(labels)
        self._define_kv_transfer_metrics(labels)
        self.perf = PerfMetrics(self.registry, model_name)  # roofline, peaks, start-up
        self.lora = LoRAMetrics(self.registry, model_name)
        self.requests = RequestMetrics(self.process_registry, labels, max_model_len)
        self._series: dict[str, RequestSeries] = {}  # by engine label, bound on first use
        self.request_series(None)  # the default engine's series exist from the start
        self.http_requests = Counter(
            "kvflow:http_requests",
            "Number of HTTP requests by route, method and status code.",
            ["route", "method", "status"],
            registry=self.process_registry,
        )
        # Created at 0 for every reason: a dashboard shows 0, not "No data".
        self.requests_rejected = Counter(
            "kvflow:requests_rejected",
            "Requests refused or ended for load or time: queue_full (HTTP 429), "
            "queue_timeout (503), timeout (the request's own, 408).",
            ["model_name", "reason"],
            registry=self.process_registry,
        )
        for reason in REJECTION_REASONS:
            self.requests_rejected.labels(model_name, reason)
        self._define_security_metrics()
        self.http_duration = Histogram(
            "kvflow:http_request_duration_seconds",
            "Duration of HTTP requests in seconds (whole stream for SSE responses).",
            ["route", "method"],
            registry=self.process_registry,
        )

    def _define_engine_metrics(self, labels: list[str]) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvflow:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvflow:{name}", doc, labels, registry=self.registry)

        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter(
            "num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.worker_restarts = counter(
            "worker_restarts", "Workers that came back after a crash (the engine recovered)."
        )
        self.requests_resumed = counter(
            "requests_resumed",
            "Requests preempted by a worker crash and resumed by recomputation.",
        )
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Number of spec decoding drafts."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.spec_decode_accepted_per_pos = Counter(
            "kvflow:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*labels, "position"],
            registry=self.registry,
        )
        self.iteration_tokens = Histogram(
            "kvflow:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=self.registry,
        )

    def _define_media_metrics(self, labels: list[str]) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvflow:{name}", doc, labels, registry=self.registry)

        self.mm_encoder_cache_queries = counter(
            "mm_encoder_cache_queries", "Images looked up in the vision encoder's cache."
        )
        self.mm_encoder_cache_hits = counter(
            "mm_encoder_cache_hits", "Images whose features came from the encoder cache."
        )

    def _define_grammar_metrics(self, labels: list[str]) -> None:
        self.grammar_compile = Histogram(
            "kvflow:grammar_compile_seconds",
            "Histogram of guided-decoding grammar compile time in seconds (cache misses).",
            labels,
            buckets=GRAMMAR_COMPILE_BUCKETS,
            registry=self.registry,
        )

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvflow:{name}", doc, labels, registry=self.registry)

        self.grammar_cache_hits = counter(
            "grammar_cache_hits", "Guided requests whose grammar was already compiled."
        )
        self.grammar_cache_misses = counter(
            "grammar_cache_misses", "Guided requests whose grammar had to be compiled."
        )
        self.grammar_compile_timeouts = counter(
            "grammar_compile_timeouts", "Guided requests failed: their grammar compiled too long."
        )
        self.grammar_jump_forward_tokens = counter(
            "grammar_jump_forward_tokens",
            "Guided-output tokens the grammar forced, appended without a model step.",
        )
        self.guided_requests = Counter(
            "kvflow:guided_requests",
            "Guided requests by kind (json, json_object, regex, choice, grammar).",
            [*labels, "kind"],
            registry=self.registry,
        )

    def _define_kv_transfer_metrics(self, labels: list[str]) -> None:
        # Created at the first stats of an engine with a connector: a server without
        # one exports none of them.
        self.kv_transfer_counters = {
            field: Counter(f"kvflow:{name}", doc, labels, registry=self.registry)
            for field, (name, doc) in _KV_TRANSFER_COUNTERS.items()
        }
        self.num_requests_waiting_for_remote_kv = Gauge(
            "kvflow:num_requests_waiting_for_remote_kv",
            "Requests whose prompt KV is being pulled from a prefill instance.",
            labels,
            registry=self.registry,
        )
        self.kv_transfer_seconds = Histogram(
            "kvflow:kv_transfer_seconds",
            "Histogram of the time one step spent moving KV, by direction (load, save).",
            [*labels, "direction"],
            buckets=KV_TRANSFER_BUCKETS,
            registry=self.registry,
        )

    def _observe_kv_transfer(
        self, labels: tuple[str, str], engine: str, stats: KVTransferStats
    ) -> None:
        for field, counter in self.kv_transfer_counters.items():
            increment = self._increment(engine, f"kv_{field}", getattr(stats, field))
            counter.labels(*labels).inc(increment)
        self.num_requests_waiting_for_remote_kv.labels(*labels).set(stats.num_waiting_for_remote_kv)
        for direction, seconds in (("load", stats.load_seconds), ("save", stats.save_seconds)):
            histogram = self.kv_transfer_seconds.labels(*labels, direction)
            for value in seconds:
                histogram.observe(value)

    def _define_security_metrics(self) -> None:
        # Both created at 0: an alert on "increase > 0" has a series from the start.
        self.cluster_auth_failures = Counter(
            "kvflow:cluster_auth_failures",
            "Peers refused on the cluster's tcp:// ZeroMQ links (no CURVE, or not the "
            "cluster's key), by process: this frontend's, or an engine's role.",
            ["model_name", "engine", "role"],
            registry=self.registry,
        )
        self.cluster_auth_failures.labels(self.model_name, "", "frontend")
        self.kv_params_rejected = Counter(
            "kvflow:kv_transfer_params_rejected",
            "Requests refused (400) for kv_transfer_params the proxy did not sign.",
            ["model_name"],
            registry=self.process_registry,  # this API server's requests
        )
        self.kv_params_rejected.labels(self.model_name)

    def count_kv_params_rejected(self) -> None:
        self.kv_params_rejected.labels(self.model_name).inc()

    def observe_own_auth_failures(self, count: int) -> None:
        """This process's refusals so far (kvflow/runtime/cluster_auth.py), at scrape."""
        increment = self._increment("", "auth_failures_frontend", count)
        self.cluster_auth_failures.labels(self.model_name, "", "frontend").inc(increment)

    def _observe_auth_failures(self, engine: str, by_role: dict[str, int]) -> None:
        for role, count in by_role.items():
            increment = self._increment(engine, f"auth_failures_{role}", count)
            self.cluster_auth_failures.labels(self.model_name, engine, role).inc(increment)

    # ---- feeding ----------------------------------------------------------------------

    def observe_scheduler_stats(self, stats: SchedulerStats) -> None:
        labels = (self.model_name, stats.engine)
        self.num_requests_running.labels(*labels).set(stats.num_running)
        self.num_requests_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_cache_usage.labels(*labels).set(stats.kv_cache_usage)
        for field, attr in _CUMULATIVE.items():
            # Created at 0 by the engine's first stats (as vLLM's are at start-up): a
            # counter that has not counted yet (no preemption, no prefix-cache hit) reads
            # 0 on a dashboard, not "No data".
            counter = getattr(self, attr).labels(*labels)
            increment = self._increment(stats.engine, field, getattr(stats, field))
            if increment:
                counter.inc(increment)
        for position, value in enumerate(stats.spec_decode_accepted_per_pos):
            increment = self._increment(stats.engine, f"accepted_per_pos_{position}", value)
            per_pos = self.spec_decode_accepted_per_pos.labels(*labels, str(position))
            if increment:
                per_pos.inc(increment)
        iteration = self.iteration_tokens.labels(*labels)
        for num_tokens in stats.step_tokens:
            iteration.observe(num_tokens)
        self.perf.observe(stats, self._increment)
        if stats.grammar is not None:
            self._observe_grammar(labels, stats.engine, stats.grammar)
        if stats.kv_transfer is not None:
            self._observe_kv_transfer(labels, stats.engine, stats.kv_transfer)
        self._observe_auth_failures(stats.engine, stats.cluster_auth_failures)
        if stats.lora is not None:
            self.lora.observe(stats.lora, stats.timestamp)

    def count_lora_request(self, lora: LoRARequest | None) -> None:
        self.lora.count(lora)

    def _observe_grammar(self, labels: tuple[str, str], engine: str, stats: GrammarStats) -> None:
        for seconds in stats.compile_seconds:
            self.grammar_compile.labels(*labels).observe(seconds)
        for field, counter in (
            ("cache_hits", self.grammar_cache_hits),
            ("cache_misses", self.grammar_cache_misses),
            ("compile_timeouts", self.grammar_compile_timeouts),
            ("jump_forward_tokens", self.grammar_jump_forward_tokens),
        ):
            counter.labels(*labels).inc(
                self._increment(engine, f"grammar_{field}", getattr(stats, field))
            )
        for kind, count in stats.requests_by_kind.items():
            increment = self._increment(engine, f"guided_{kind}", count)
            self.guided_requests.labels(*labels, kind).inc(increment)

    def _increment(self, engine: str, field: str, value: float) -> float:
        last = self._last_cumulative.get((engine, field), 0)
        self._last_cumulative[(engine, field)] = value
        return value - last if value >= last else value

    def observe_http(self, route: str, method: str, status: int, duration_s: float) -> None:
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route, method).observe(duration_s)

    def count_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def request_series(self, engine: str | None) -> RequestSeries:
        """The request-level series of one engine label (None: the default one)."""
        label = self.default_engine if engine is None else engine
        series = self._series.get(label)
        if series is None:
            series = self._series[label] = RequestSeries(self.requests, self.model_name, label)
        return series

    def track_request(self, arrival_time: float) -> RequestTracker:
        return RequestTracker(self.request_series, arrival_time)

    def share(self, directory: Path, frontend_id: str) -> SharedProcessMetrics:
        """Publish this process's families for its sibling API servers and answer
        scrapes with the sum over all of them (metrics_fanin.py)."""
        self.shared = SharedProcessMetrics(directory, frontend_id, self.process_registry)
        return self.shared

    def render(self) -> bytes:
        self.observe_own_auth_failures(REFUSALS.count)
        engine = generate_latest(self.registry)
        if self.shared is not None:
            return engine + self.shared.render()
        return engine + generate_latest(self.process_registry)
