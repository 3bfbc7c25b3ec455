"""`kvflow bench routing`: runs every policy at both levels and reports what it routed."""

from __future__ import annotations

import json

import pytest

from kvflow.services.cli import main


def test_bench_routing_times_every_policy_at_both_levels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "routing", "--num-requests", "40", "--prefix-len", "64"]
    assert main([*argv, "--suffix-len", "16", "--num-prefixes", "2", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    by_key = {(r["level"], r["policy"]): r for r in results}
    assert set(by_key) == {
        (level, policy)
        for level in ("router", "client")
        for policy in ("prefix-aware", "least-load", "round-robin")
    }
    for r in results:
        assert r["requests"] == 40 and 0 < r["p50_us"] <= r["p99_us"]
        assert sum(r["engine_share"]) == pytest.approx(1.0)
    assert by_key[("router", "round-robin")]["engine_share"] == [0.5, 0.5]
    # Two prefixes: after the first request of each, a known prefix decides unless the
    # owner is overloaded; the client level routes through the same router.
    aware = by_key[("router", "prefix-aware")]
    assert aware["prefix_hit_rate"] >= 0.5
    assert by_key[("client", "prefix-aware")]["prefix_hit_rate"] == aware["prefix_hit_rate"]
    assert by_key[("router", "least-load")]["prefix_hit_rate"] == 0.0


def test_bench_routing_refuses_an_unknown_policy() -> None:
    with pytest.raises(SystemExit, match="unknown"):
        main(["bench", "routing", "--policies", "random", "--num-requests", "4"])
