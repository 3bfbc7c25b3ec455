"""LoRA metrics, under vLLM's names with the `kvflow:` prefix.

- `kvflow:lora_requests_info` (gauge): one series whose labels name the adapters of the
  running and of the waiting requests (comma-separated) and `max_lora`; its value is
  the time of the stats it came from (as vLLM exports it). Each engine's stats replace
  the series.
- `kvflow:lora_requests_total{lora_name}` (counter): requests served per adapter.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvflow.proto.lora import LoRARequest
from kvflow.proto.stats import LoRAStats


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.info = Gauge(
            "kvflow:lora_requests_info",
            "Running stats on LoRA requests: the adapters of running and waiting requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )
        self.requests = Counter(
            "kvflow:lora_requests",
            "Requests served per LoRA adapter.",
            ["model_name", "lora_name"],
            registry=registry,
        )

    def observe(self, stats: LoRAStats, timestamp: float) -> None:
        self.info.clear()
        labels = (str(stats.max_lora), ",".join(stats.waiting), ",".join(stats.running))
        self.info.labels(*labels).set(timestamp)

    def count(self, lora: LoRARequest | None) -> None:
        if lora is not None:
            self.requests.labels(self.model_name, lora.lora_name).inc()
