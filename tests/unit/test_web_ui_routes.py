"""The web UI's data: the scheduler's KV block map and the frontend's engine view."""

from __future__ import annotations

from kvflow.block_hash import BlockHash
from kvflow.proto.stats import PhaseTotals, SchedulerStats, StepRecord
from kvflow.services.frontend.engine_view import EngineView
from kvflow.services.scheduler.block_map import block_map
from kvflow.services.scheduler.block_pool import BlockPool


def test_block_map_buckets_used_cached_and_free_blocks() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2 in use
    assert blocks is not None
    pool.cache_full_blocks(blocks[2:], [BlockHash(b"h" * 32)])
    pool.free_blocks(blocks[2:])  # 2: free but cached
    exact = block_map(pool, max_buckets=8)
    assert (exact.num_blocks, exact.used, exact.cached) == (
        8,
        [100, 100] + [0] * 6,
        [0, 0, 100, 0, 0, 0, 0, 0],
    )
    halves = block_map(pool, max_buckets=2)
    assert (halves.used, halves.cached) == ([50, 0], [25, 0])


def test_block_map_of_a_large_pool_reads_a_bounded_sample() -> None:
    pool = BlockPool(100_000)
    assert pool.get_new_blocks(50_000) is not None  # the first half, by id
    summary = block_map(pool, max_buckets=4, max_samples=40)
    assert summary.used == [100, 100, 0, 0] and summary.cached == [0, 0, 0, 0]


def _stats(
    t: float, hits: int, queries: int, seconds: float, steps: list[StepRecord]
) -> SchedulerStats:
    return SchedulerStats(
        timestamp=t,
        engine="0",
        num_running=1,
        num_waiting=2,
        kv_cache_usage=0.5,
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        roofline={"decode": PhaseTotals(int(10 * seconds), seconds, 1e9 * seconds, 1e9 * seconds)},
        peak_flops=1e10,
        peak_bandwidth=4e9,
        recent_steps=steps,
        incarnation="a",
    )


def test_engine_view_takes_rates_over_its_window_and_keeps_the_steps() -> None:
    view = EngineView()
    view.observe(_stats(100.0, 0, 0, 1.0, [StepRecord(5, 0, 0.002)]))
    view.observe(_stats(100.5, 30, 40, 2.0, [StepRecord(0, 1, 0.001, 1)]))
    (engine,) = view.snapshot()["engines"]
    assert (engine["num_running"], engine["num_waiting"]) == (1, 2)
    assert engine["prefix_cache_hit_rate"] == 0.75
    assert engine["steps"] == [[5, 0, 2.0, 0], [0, 1, 1.0, 1]]
    decode = engine["roofline"]["decode"]
    assert (decode["pct_compute_roofline"], decode["pct_bandwidth_roofline"]) == (10.0, 25.0)
    # A restarted scheduler (new incarnation) starts a fresh history.
    restarted = _stats(101.0, 0, 0, 0.5, [])
    restarted.incarnation = "b"
    view.observe(restarted)
    assert view.snapshot()["engines"][0]["steps"] == []
