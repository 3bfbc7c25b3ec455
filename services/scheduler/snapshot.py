"""The scheduler's counts at one moment, for the stats message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.proto.kv_transfer import KVTransferStats
from kvflow.proto.stats import LoRAStats
from kvflow.services.scheduler.spec_decode.speculator import SpecDecodeCounters

if TYPE_CHECKING:
    from kvflow.services.scheduler.scheduler import Scheduler


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


def take_snapshot(scheduler: Scheduler) -> SchedulerSnapshot:
    """The counts for one stats message (the features' stats are taken)."""
    stats = FeatureStats()
    for f in scheduler.features:
        f.add_stats(stats)
    kv_cache = scheduler.kv_cache
    return SchedulerSnapshot(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=kv_cache.usage,
        prefix_cache_queries=kv_cache.prefix_cache_queries,
        prefix_cache_hits=kv_cache.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        features=stats,
    )
