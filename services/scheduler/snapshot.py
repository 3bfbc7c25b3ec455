"""The scheduler's counts at one moment, for the stats message."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.proto.kv_transfer import KVTransferStats
from kvflow.proto.stats import LoRAStats
from kvflow.services.scheduler.spec_decode.speculator import SpecDecodeCounters


@dataclass
class FeatureStats:
    """What the features add to the scheduler's snapshot."""

    spec_decode: SpecDecodeCounters | None = None  # None: no speculative decoding
    kv_transfer: KVTransferStats | None = None  # None: no KV connector
    lora: LoRAStats | None = None  # None: LoRA off


@dataclass
class SchedulerSnapshot:
    """The core's own counts at one moment (the loop adds its counters and sends
    `proto.stats.SchedulerStats`)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    features: FeatureStats  # what the step features count
