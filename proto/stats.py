"""Scheduler -> frontend(s): periodic engine statistics for /metrics and /health."""

from __future__ import annotations

import msgspec


class SchedulerStats(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    timestamp: float
    engine: str  # data-parallel rank / engine identity, the `engine` metric label
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    # Cumulative counters since start (the frontend exports deltas as counters).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    # Tokens of each step since the last stats message (kvflow:iteration_tokens_total).
    step_tokens: list[int] = []
