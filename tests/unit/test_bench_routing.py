"""`kvflow bench routing`: runs every policy at both levels and reports what it routed."""

from __future__ import annotations

import json

import pytest

from kvflow.cli.main import main


def test_bench_routing_times_every_policy_at_both_levels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "routing", "--levels", "router,client", "--num-requests", "40"]
    assert (
        main([*argv, "--prefix-len", "64", "--suffix-len", "16", "--num-prefixes", "2", "--json"])
        == 0
    )
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


@pytest.mark.slow
def test_bench_routing_e2e_round_trips_through_fake_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Real EngineClient, real zmq, fake engines in their own processes: DP=1 baseline
    then DP=2, every request answered."""
    argv = ["bench", "routing", "--levels", "e2e", "--policies", "prefix-aware"]
    assert main([*argv, "--e2e-requests", "30", "--rate", "300", "--json"]) == 0
    baseline, dp2 = json.loads(capsys.readouterr().out)
    assert (baseline["policy"], baseline["num_engines"]) == ("dp=1", 1)
    assert (dp2["policy"], dp2["num_engines"], dp2["requests"]) == ("prefix-aware", 2, 30)
    assert 0 < dp2["p50_us"] <= dp2["p99_us"]
    assert dp2["added_p50_us"] == pytest.approx(dp2["p50_us"] - baseline["p50_us"], abs=0.02)
