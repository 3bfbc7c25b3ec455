"""The scheduler's counts at one moment, for the stats message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.proto.kv_transfer import KVTransferStats
from kvflow.proto.stats import LoRAStats
from kvflow.services.scheduler.spec_decode.speculator import SpecDecodeCounters

if TYPE_CHECKING:
    from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
    from kvflow.services.scheduler.request import Request
    from kvflow.services.scheduler.step_features import StepFeature


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


def take_snapshot(
    features: Sequence[StepFeature], kv_cache: KVCacheManager, running: list[Request],
    num_waiting: int, num_preemptions: int,
) -> SchedulerSnapshot:  # fmt: skip
    """The scheduler's counts and what its features add (the KV transfer times are taken)."""
    stats = FeatureStats()
    for f in features:
        f.add_stats(stats)
    return SchedulerSnapshot(
        num_running=len(running),
        num_waiting=num_waiting,
        kv_cache_usage=kv_cache.usage,
        prefix_cache_queries=kv_cache.prefix_cache_queries,
        prefix_cache_hits=kv_cache.prefix_cache_hits,
        num_preemptions=num_preemptions,
        features=stats,
    )
