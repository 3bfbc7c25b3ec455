"""The sans-IO parts of `kvflow bench disagg`: the core split, the load's schedule and
the summary's percentiles."""

from __future__ import annotations

import pytest

from kvflow.bench.datasets import TokenSpace
from kvflow.bench.disagg import core_split
from kvflow.bench.mixed_load import MixedLoad, summarize
from kvflow.bench.request_client import RequestOutput


def test_cores_split_in_halves_the_prefill_side_taking_the_odd_one() -> None:
    split = core_split(5, [0, 2, 4, 6, 8, 10], pin=True)
    assert split["num_threads"] == {"colocated": 5, "prefill": 3, "decode": 2}
    assert split["cpus"] == {"colocated": [0, 2, 4, 6, 8], "prefill": [0, 2, 4], "decode": [6, 8]}
    for cpus, pin in (([0, 1], True), ([0, 1, 2, 3], False)):  # too few cores, or asked not to
        assert set(core_split(4, cpus, pin)["cpus"].values()) == {None}


def test_the_schedule_interleaves_shorts_and_longs_with_fresh_prompts() -> None:
    load = MixedLoad(duration_s=4, short_rate=2, short_prompt=5, short_output=7,
                     long_every_s=2, long_prompt=30, long_output=1, seed=3)  # fmt: skip
    schedule = load.schedule(TokenSpace(1000, [0, 1, 2]))
    times = [at for at, _, _ in schedule]
    assert times == sorted(times)
    shorts = [(at, r) for at, kind, r in schedule if kind == "short"]
    longs = [(at, r) for at, kind, r in schedule if kind == "long"]
    assert [at for at, _ in shorts] == [0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5]
    assert [at for at, _ in longs] == [1, 3]
    assert {(r.prompt_len, r.expected_output_len) for _, r in shorts} == {(5, 7)}
    assert {(r.prompt_len, r.expected_output_len) for _, r in longs} == {(30, 1)}
    prompts = [tuple(r.prompt) for _, _, r in schedule]
    assert len(set(prompts)) == len(prompts)  # no prefix-cache hit between requests
    assert not {0, 1, 2} & {t for p in prompts for t in p}
    assert load.schedule(TokenSpace(1000, [0, 1, 2])) == schedule  # seeded


def test_summary_pools_the_short_gaps_and_counts_failures() -> None:
    shorts = [
        RequestOutput(4, success=True, ttft=0.1, itl=[0.01, 0.03]),
        RequestOutput(4, success=True, ttft=0.3, itl=[0.02]),
        RequestOutput(4, success=False, error="HTTP 500: boom"),
    ]
    longs = [RequestOutput(30, success=True, ttft=2.0), RequestOutput(30, success=True, ttft=4.0)]
    summary = summarize({"short": shorts, "long": longs})
    assert summary["short_itl_ms"] == {"p50": 20.0, "p99": pytest.approx(29.8), "max": 30.0}
    assert summary["short_ttft_ms"] == {"p50": 200.0, "p99": pytest.approx(298.0)}
    assert summary["long_ttft_ms"] == {"p50": 3000.0, "max": 4000.0}
    assert (summary["short_requests"], summary["long_requests"]) == (2, 2)
    assert (summary["failed_requests"], summary["first_error"]) == (1, "HTTP 500: boom")
    empty = summarize({"short": [], "long": []})
    assert empty["short_itl_ms"] == {"p50": None, "p99": None, "max": None}
