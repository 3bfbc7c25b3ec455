"""The web UI's engine view: what each engine's `SchedulerStats` say, as one JSON snapshot.

A stats listener (about every 0.5 s per engine) keeps, per engine, the newest stats,
the last `MAX_STEPS` steps for the timeline, and the stats of the last `WINDOW_S`
seconds, from which the rates are taken (prefix-cache hit rate, % of the compute and
bandwidth roofs per step phase), as in the Grafana panels' `rate(...[1m])` but shorter.
`/ui/stats` streams `snapshot()` as server-sent events at most `MAX_UPDATES_PER_S`.

Nothing here reaches the scheduler: the view reads what the frontend receives anyway,
so an open engine view costs the engine nothing (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from kvflow.metrics.roofline import roofline_report
from kvflow.proto.stats import PhaseTotals, SchedulerStats

MAX_STEPS = 120  # timeline length
WINDOW_S = 10.0  # the rates' window
MAX_UPDATES_PER_S = 2.0


class _EngineHistory:
    def __init__(self) -> None:
        self.steps: deque[list[float]] = deque(maxlen=MAX_STEPS)
        self.window: deque[SchedulerStats] = deque()

    def add(self, stats: SchedulerStats) -> None:
        if self.window and stats.incarnation != self.window[-1].incarnation:
            self.window.clear()  # a restarted engine's counters start again at 0
            self.steps.clear()
        self.window.append(stats)
        while len(self.window) > 2 and stats.timestamp - self.window[0].timestamp > WINDOW_S:
            self.window.popleft()
        for step in stats.recent_steps:
            ms = round(step.seconds * 1000, 3)
            self.steps.append([step.prefill_tokens, step.decode_tokens, ms, step.preemptions])

    def snapshot(self) -> dict[str, Any]:
        first, last = self.window[0], self.window[-1]
        queries = last.prefix_cache_queries - first.prefix_cache_queries
        hits = last.prefix_cache_hits - first.prefix_cache_hits
        block_map = last.kv_block_map
        return {
            "engine": last.engine,
            "timestamp": last.timestamp,
            "num_running": last.num_running,
            "num_waiting": last.num_waiting,
            "kv_cache_usage": last.kv_cache_usage,
            "block_map": None
            if block_map is None
            else {
                "num_blocks": block_map.num_blocks,
                "used": block_map.used,
                "cached": block_map.cached,
            },
            "prefix_cache_hit_rate": hits / queries if queries > 0 else None,
            "prefix_cache_hit_rate_total": (
                last.prefix_cache_hits / last.prefix_cache_queries
                if last.prefix_cache_queries
                else None
            ),
            "num_preemptions": last.num_preemptions,
            "steps": list(self.steps),
            "roofline": roofline_report(
                _phase_deltas(first, last), last.peak_flops, last.peak_bandwidth
            ),
        }


def _phase_deltas(first: SchedulerStats, last: SchedulerStats) -> dict[str, PhaseTotals]:
    deltas = {}
    for phase, now in last.roofline.items():
        before = first.roofline.get(phase, PhaseTotals()) if first is not last else PhaseTotals()
        deltas[phase] = PhaseTotals(
            now.steps - before.steps,
            now.seconds - before.seconds,
            now.flops - before.flops,
            now.bytes - before.bytes,
        )
    return deltas


class EngineView:
    """A stats listener (`EngineClient.add_stats_listener`) and the snapshot it serves."""

    def __init__(self) -> None:
        self._engines: dict[str, _EngineHistory] = {}

    def observe(self, stats: SchedulerStats) -> None:
        self._engines.setdefault(stats.engine, _EngineHistory()).add(stats)

    def snapshot(self) -> dict[str, Any]:
        return {
            "time": time.time(),
            "engines": [self._engines[name].snapshot() for name in sorted(self._engines)],
        }
