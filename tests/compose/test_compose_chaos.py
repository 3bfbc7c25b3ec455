"""Chaos in the `dp`, `disagg` and `tp` profiles: load at concurrency 16 while a random
role is SIGKILLed every 20 s (tests/compose/chaos.py). No request may be lost (left
without an answer), and the service must serve again afterwards; in `disagg` a prefill
or decode kill may cost no error (the proxy resends their requests). `make test-compose`
runs it for KVFLOW_CHAOS_DURATION_S (60 s) per profile; the table in
docs/deployment.md ("Chaos") comes from 180 s runs of chaos.py."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest
from chaos import PROFILES, ChaosConfig, Tally, classify, profile_stack, run_chaos
from test_compose import live
from test_compose_tp import _readable_copy

DURATION_S = float(os.environ.get("KVFLOW_CHAOS_DURATION_S", "60"))


def test_every_role_of_each_profile_is_eligible() -> None:
    """The killer picks from every kvflow role the profile starts: the entry point too
    (its death drops connections, an error the client sees, never a silent loss)."""
    from test_compose import compose_services

    services = compose_services()
    for name, profile in PROFILES.items():
        started = {s for s, v in services.items() if name in v.get("profiles", [])}
        if name == "dp":  # the default engine's roles serve engine 0 of the dp frontend
            started |= {"worker", "scheduler", "detokenizer"}
        assert set(profile.roles) == started, name
        assert profile.target in profile.roles


def test_a_reply_is_exact_complete_or_an_error() -> None:
    reply = {"choices": [{"text": "abc", "finish_reason": "length"}]}
    full = reply | {"usage": {"completion_tokens": 4}}
    assert classify(full, "abc", 4)[0] == "exact"
    assert classify(full, "abd", 4)[0] == "complete"
    assert classify(reply | {"usage": {"completion_tokens": 3}}, "abc", 4)[0] == "error"
    assert classify({"error": "x"}, "abc", 4)[0] == "error"


def test_an_error_is_charged_to_the_role_killed_last() -> None:
    tally = Tally()
    tally.kills = [(1.0, "worker"), (5.0, "scheduler")]
    tally.record("error", "500", 6.0)
    tally.record("lost", "timeout", 2.0)
    tally.record("error", "500", 0.5)
    assert tally.errors_by_role == {"error:scheduler": 1, "lost:worker": 1, "error:none": 1}


@live
@pytest.mark.slow
@pytest.mark.parametrize("profile", ["dp", "disagg", "tp"])
def test_chaos_loses_no_request(profile: str, tiny_model_dir: Any, tmp_path: Any) -> None:
    model = None
    if profile == "tp":
        model = str(_readable_copy(tiny_model_dir("llama"), tmp_path / "model"))
    config = ChaosConfig(
        profile, duration_s=DURATION_S, seed=random.randrange(1 << 16),
        project=f"kvflow-compose-test-chaos-{profile}", tp_model_dir=model,
    )  # fmt: skip
    with profile_stack(config) as (api, compose, env):
        summary = run_chaos(api, compose, env, config).summary()
    print(f"\n[compose] chaos {profile} (seed {config.seed}): {json.dumps(summary)}", flush=True)
    assert summary["lost"] == 0, summary
    assert summary["exact"] + summary["complete"] > 0, summary  # type: ignore[operator]
    assert summary["recovered_s"] is not None, summary
    if profile == "disagg":  # the proxy resends what a dead instance held (recomputable)
        errors = summary["errors_by_last_kill"]
        assert isinstance(errors, dict)
        assert not {"error:prefill", "error:decode"} & set(errors), summary
