"""The data-parallel routing policies (kvflow/routing.py), without sockets."""

from __future__ import annotations

import random

import pytest

from kvflow.routing import NoEngineError, Router, RoutingConfig


def _router(policy: str, engines: int = 2, **kwargs: int) -> Router:
    return Router(RoutingConfig(policy=policy, block_size=16, **kwargs), engines)  # type: ignore[arg-type]


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(length)]


def test_least_load_score_is_waiting_times_four_plus_running() -> None:
    router = _router("least-load", engines=3)
    router.observe_load(0, waiting=1, running=0)  # 4
    router.observe_load(1, waiting=0, running=3)  # 3
    router.observe_load(2, waiting=0, running=5)  # 5
    assert [router.score(i) for i in range(3)] == [4, 3, 5]
    assert router.route([1, 2, 3]).engine == 1


def test_least_load_counts_requests_sent_since_the_last_stats() -> None:
    router = _router("least-load")
    router.observe_load(0, waiting=0, running=0)
    router.observe_load(1, waiting=0, running=2)
    # A burst before the next stats: engine 0 takes two, then they tie and alternate.
    picks = [router.route([7]).engine for _ in range(6)]
    assert picks[:2] == [0, 0]
    assert sorted(picks[2:]) == [0, 0, 1, 1]
    router.observe_load(0, waiting=0, running=1)  # stats now count what was sent
    assert router.score(0) == 1


def test_round_robin_skips_unavailable_engines() -> None:
    router = _router("round-robin", engines=3)
    assert [router.route([1]).engine for _ in range(4)] == [0, 1, 2, 0]
    router.set_available(1, False)
    assert [router.route([1]).engine for _ in range(4)] == [2, 0, 2, 0]


def test_prefix_aware_keeps_a_shared_256_token_prefix_on_one_engine() -> None:
    router = _router("prefix-aware", engines=2)
    prefix = _prompt(0, 256)
    first = router.route(prefix + _prompt(1, 40))
    assert not first.prefix_hit
    for seed in range(2, 12):
        decision = router.route(prefix + _prompt(seed, 40))
        assert decision.engine == first.engine and decision.prefix_hit
        router.observe_load(first.engine, waiting=0, running=1)  # not overloaded


def test_prefix_aware_spreads_unrelated_prompts() -> None:
    router = _router("prefix-aware", engines=2)
    engines = [router.route(_prompt(seed, 300)).engine for seed in range(20)]
    assert engines.count(0) == engines.count(1) == 10


def test_prefix_aware_falls_back_to_least_load_when_overloaded() -> None:
    router = _router("prefix-aware", engines=2, overload_threshold=8)
    prefix = _prompt(0, 256)
    owner = router.route([*prefix, 1]).engine
    router.observe_load(owner, waiting=2, running=1)  # 9 > 0 + 8
    router.observe_load(1 - owner, waiting=0, running=0)
    decision = router.route([*prefix, 2])
    assert decision.engine == 1 - owner and decision.policy == "least-load"
    router.observe_load(owner, waiting=2, running=0)  # 8: within the margin
    router.observe_load(1 - owner, waiting=0, running=0)
    # The longest known prefix now lives on the other engine too (it took the last one).
    assert router.route([*prefix, 3]).prefix_hit


def test_prefix_aware_uses_the_engines_hash_with_the_salt() -> None:
    router = _router("prefix-aware", engines=2)
    prompt = _prompt(0, 64)
    owner = router.route(prompt, cache_salt="a").engine
    assert router.route(prompt, cache_salt="a").prefix_hit
    other = router.route(prompt, cache_salt="b")  # another tenant: no shared blocks
    assert not other.prefix_hit and other.engine != owner


def test_prefix_aware_tells_images_apart() -> None:
    """Placeholder runs are the same ids for every image: the images' hashes decide,
    as in the engines' block hashes."""
    router = _router("prefix-aware", engines=2)
    prompt = [9] * 32 + _prompt(0, 16)  # an image's placeholders fill blocks 0 and 1
    owner = router.route(prompt, image_spans=[(0, 32, "cat")]).engine
    other = router.route(prompt, image_spans=[(0, 32, "dog")])  # no block in common
    assert not other.prefix_hit and other.engine != owner
    again = router.route(prompt, image_spans=[(0, 32, "cat")])
    assert again.prefix_hit and again.engine == owner
    assert not router.route(prompt).prefix_hit  # the ids alone are yet another prefix


def test_a_partial_block_is_not_a_prefix() -> None:
    router = _router("prefix-aware", engines=2)
    router.route(list(range(15)))  # less than one block: nothing to remember
    assert not router.route(list(range(15))).prefix_hit


def test_forgotten_and_unavailable_engines_lose_their_prefixes() -> None:
    router = _router("prefix-aware", engines=2)
    prompt = _prompt(0, 64)
    owner = router.route(prompt).engine
    router.set_available(owner, False)
    assert router.route(prompt).engine == 1 - owner
    router.set_available(owner, True)
    router.forget(1 - owner)  # restarted: its cache is empty
    assert not router.route(prompt).prefix_hit


def test_the_prefix_map_is_bounded() -> None:
    router = _router("prefix-aware", engines=2, max_prefix_entries=8)
    for seed in range(10):
        router.route(_prompt(seed, 64))  # 4 blocks each
    assert len(router._prefixes) == 8


def test_explicit_rank_wins_and_a_dead_rank_is_refused() -> None:
    router = _router("prefix-aware", engines=2)
    prompt = _prompt(0, 64)
    router.route(prompt, rank=0)
    assert router.route(prompt, rank=1).engine == 1
    router.set_available(1, False)
    with pytest.raises(NoEngineError, match="data_parallel_rank 1"):
        router.route(prompt, rank=1)
    with pytest.raises(NoEngineError):
        router.route(prompt, rank=5)
    router.set_available(0, False)
    with pytest.raises(NoEngineError, match="no engine"):
        router.route(prompt)


def test_one_engine_needs_no_prefix_map() -> None:
    router = _router("prefix-aware", engines=1)
    assert router.route(_prompt(0, 64)).engine == 0
    assert not router._prefixes
