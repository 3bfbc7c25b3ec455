"""`kvflow bench serve` math: metrics on hand-computed requests, the arrival process,
and the datasets (random, sharegpt, prefix_repetition)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvflow.bench import datasets
from kvflow.bench.latency import latency_stats
from kvflow.bench.request_client import RequestOutput
from kvflow.bench.serve import arrival_times, parse_rates
from kvflow.bench.serve_metrics import (
    calculate_metrics,
    parse_metric_names,
    parse_percentiles,
    parse_slo,
    percentile_key,
)

# ---- metrics ------------------------------------------------------------------------


def _out(
    prompt_len: int, start: float, ttft: float, itl: list[float], tokens: int
) -> RequestOutput:
    return RequestOutput(
        prompt_len=prompt_len,
        success=True,
        generated_text="x" * tokens,
        output_tokens=tokens,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=start,
    )


def three_requests() -> list[RequestOutput]:
    """A: 4 tokens in 4 chunks, B: 2 tokens, C: 1 token; D failed."""
    return [
        _out(10, 100.0, 0.1, [0.05, 0.05, 0.1], 4),  # e2el 0.3, tpot 0.2/3
        _out(20, 100.5, 0.2, [0.1], 2),  # e2el 0.3, tpot 0.1
        _out(30, 101.2, 0.4, [], 1),  # e2el 0.4, no tpot (goodput sees 0)
        RequestOutput(prompt_len=40, error="HTTP 500: boom"),
    ]


def _metrics(goodput: dict[str, float] | None = None, percentiles: list[float] | None = None):  # type: ignore[no-untyped-def]
    return calculate_metrics(
        three_requests(), 2.0, percentiles or [50.0, 99.0], goodput or {}, lambda text: 0
    )


def test_counts_and_throughputs() -> None:
    m = _metrics()
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (60, 7)  # failed requests count nothing
    assert m.output_lens == [4, 2, 1, 0]
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    assert m.request_goodput == 0.0  # no SLOs given


def test_ttft_stats_mean_median_std_percentiles() -> None:
    ttft = _metrics().stats["ttft"]  # 100, 200, 400 ms
    assert ttft.mean == pytest.approx(700 / 3)
    assert ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx(math.sqrt((133.333**2 + 33.333**2 + 166.667**2) / 3), rel=1e-4)
    # linear: rank 0.99 * 2 = 1.98 between 200 and 400
    assert ttft.percentiles == [(50.0, pytest.approx(200.0)), (99.0, pytest.approx(396.0))]


def test_tpot_excludes_single_token_requests() -> None:
    tpot = _metrics().stats["tpot"]  # (0.3-0.1)/3 and (0.3-0.2)/1 -> 66.67, 100 ms
    assert tpot.mean == pytest.approx((200 / 3 + 100) / 2)
    assert tpot.percentiles[1] == (99.0, pytest.approx(200 / 3 + 0.99 * (100 - 200 / 3)))


def test_itl_is_per_chunk_and_e2el() -> None:
    m = _metrics()
    itl = m.stats["itl"]  # 50, 50, 100, 100 ms
    assert (itl.mean, itl.median, itl.std) == (
        pytest.approx(75.0),
        pytest.approx(75.0),
        pytest.approx(25.0),
    )
    assert itl.percentiles[1] == (99.0, pytest.approx(100.0))
    e2el = m.stats["e2el"]  # 300, 300, 400 ms
    assert (e2el.mean, e2el.median) == (pytest.approx(1000 / 3), pytest.approx(300.0))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 250.0}, 2),  # A, B
        ({"tpot": 80.0}, 2),  # A (66.7), C (TPOT 0); B is 100
        ({"ttft": 250.0, "tpot": 80.0}, 1),  # A only
        ({"e2el": 350.0}, 2),  # A, B
        ({"ttft": 50.0}, 0),
    ],
)
def test_goodput(slos: dict[str, float], good: int) -> None:
    assert _metrics(slos).request_goodput == pytest.approx(good / 2.0)


def test_peak_output_rate_and_concurrency() -> None:
    m = _metrics()
    # second 0 from t=100: A's 4 chunks and B's 2; C's one chunk lands in second 1.
    assert m.max_output_tokens_per_s == 6.0
    assert m.max_concurrent_requests == 2  # A and B overlap second 0


def test_output_tokens_fall_back_to_counting_the_text() -> None:
    out = _out(5, 0.0, 0.1, [0.1, 0.1], 0)
    out.generated_text = "a b c"
    m = calculate_metrics([out], 1.0, [99.0], {}, lambda text: len(text.split()))
    assert m.output_lens == [3]
    assert m.stats["tpot"].mean == pytest.approx(100.0)  # (0.3 - 0.1) / 2


def test_no_successful_request_reads_as_zero() -> None:
    m = calculate_metrics([RequestOutput(prompt_len=3)], 1.0, [99.0], {"ttft": 1.0}, len)
    assert (m.completed, m.failed, m.total_output, m.request_goodput) == (0, 1, 0, 0.0)
    assert m.stats["ttft"].mean == 0.0 and m.stats["itl"].percentiles == [(99.0, 0.0)]
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (0.0, 0)


def test_flag_parsers() -> None:
    assert parse_slo("ttft:100") == ("ttft", 100.0)
    assert parse_slo("e2el:2.5") == ("e2el", 2.5)
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:fast", "ttft:nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_slo(bad)
    assert parse_percentiles("25,50,99.9") == [25.0, 50.0, 99.9]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_percentiles("101")
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_metric_names("ttft,latency")
    assert parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "fast", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    assert (percentile_key(99.0), percentile_key(99.9), percentile_key(50)) == (
        "p99",
        "p99.9",
        "p50",
    )


def test_latency_stats() -> None:
    stats = latency_stats([4.0, 1.0, 3.0, 2.0])
    assert stats["avg_latency"] == 2.5
    assert stats["latencies"] == [4.0, 1.0, 3.0, 2.0]
    assert stats["percentiles"]["10"] == pytest.approx(1.3)
    assert stats["percentiles"]["50"] == pytest.approx(2.5)
    assert stats["percentiles"]["99"] == pytest.approx(3.97)


# ---- arrivals -----------------------------------------------------------------------


def test_arrivals_deterministic_per_seed() -> None:
    a = arrival_times(50, 4.0, 1.0, np.random.default_rng(7))
    b = arrival_times(50, 4.0, 1.0, np.random.default_rng(7))
    c = arrival_times(50, 4.0, 1.0, np.random.default_rng(8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert a[-1] == pytest.approx(49 / 4.0)  # scaled to the nominal span (vLLM)


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_arrival_gaps_are_gamma(burstiness: float, cv: float) -> None:
    """Mean gap 1/rate; coefficient of variation 1/sqrt(burstiness) (1: Poisson)."""
    gaps = np.diff(arrival_times(20001, 8.0, burstiness, np.random.default_rng(0)))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf, 1.0, np.random.default_rng(0)).tolist() == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 1.0, 0.0, np.random.default_rng(0))


# ---- datasets -----------------------------------------------------------------------

SPACE = datasets.TokenSpace(vocab_size=1000, special_ids=[0, 1, 2])


def test_random_lengths_within_range_ratio() -> None:
    reqs = datasets.sample_random(200, 100, 20, 0.5, 0, SPACE, seed=3)
    assert len(reqs) == 200
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.expected_output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20  # really spread
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert all(3 <= t < 1000 for t in r.prompt)  # no special ids


def test_random_exact_lengths_without_ratio_and_deterministic() -> None:
    a = datasets.sample_random(10, 16, 8, 0.0, 0, SPACE, seed=1)
    assert {(r.prompt_len, r.expected_output_len) for r in a} == {(16, 8)}
    assert a == datasets.sample_random(10, 16, 8, 0.0, 0, SPACE, seed=1)
    assert a != datasets.sample_random(10, 16, 8, 0.0, 0, SPACE, seed=2)
    assert len({tuple(r.prompt) for r in a}) == 10  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        datasets.sample_random(1, 16, 8, 1.0, 0, SPACE, seed=1)


def test_random_shared_prefix() -> None:
    reqs = datasets.sample_random(6, 10, 4, 0.2, 7, SPACE, seed=5)
    prefixes = {tuple(r.prompt[:7]) for r in reqs}  # type: ignore[index]
    assert len(prefixes) == 1
    assert all(r.prompt_len == len(r.prompt) and 7 + 8 <= r.prompt_len <= 7 + 12 for r in reqs)
    assert len({tuple(r.prompt[7:]) for r in reqs}) == 6  # type: ignore[index]


def test_prefix_repetition_structure() -> None:
    reqs = datasets.sample_prefix_repetition(10, 5, 4, 3, 6, SPACE, seed=0)
    assert len(reqs) == 10
    assert all(r.prompt_len == 9 == len(r.prompt) and r.expected_output_len == 6 for r in reqs)
    counts: dict[tuple[int, ...], int] = {}
    for r in reqs:
        key = tuple(r.prompt[:5])  # type: ignore[index]
        counts[key] = counts.get(key, 0) + 1
    assert sorted(counts.values()) == [3, 3, 4]
    assert len({tuple(r.prompt[5:]) for r in reqs}) == 10  # type: ignore[index]
    assert reqs == datasets.sample_prefix_repetition(10, 5, 4, 3, 6, SPACE, seed=0)
    # shuffled: not simply prefix 0, 1, 2, 0, 1, 2, ...
    firsts = [r.prompt[0] for r in reqs]  # type: ignore[index]
    assert firsts != [firsts[i % 3] for i in range(10)]


def _count_words(text: str, special: bool) -> int:
    return len(text.split()) + (1 if special else 0)  # +1: a BOS, as a tokenizer would add


@pytest.fixture()
def sharegpt_file(tmp_path: Path) -> Path:
    conversations = [
        {"id": "one-turn", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "short", "conversations": [{"value": "hi"}, {"value": "hello there you all"}]},
        {"id": "a", "conversations": [{"value": "w " * 10}, {"value": "r " * 5}]},
        {"id": "b", "conversations": [{"value": "w " * 20}, {"value": "r " * 8}, {"value": "x"}]},
        {"id": "tiny-reply", "conversations": [{"value": "w " * 6}, {"value": "ok"}]},
        {"id": "no-turns"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    return path


def test_sharegpt_parsing_and_filter(sharegpt_file: Path) -> None:
    pairs = datasets.load_sharegpt(sharegpt_file)
    assert len(pairs) == 4  # one-turn and no-turns dropped
    reqs = datasets.sample_sharegpt(pairs, 2, _count_words, seed=0)
    # "short" (2-token prompt) and "tiny-reply" (1-token reply) fail vLLM's filter.
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(11, 5), (21, 8)]
    assert all(isinstance(r.prompt, str) for r in reqs)
    assert reqs == datasets.sample_sharegpt(pairs, 2, _count_words, seed=0)


def test_sharegpt_fixed_output_len_and_cycling(sharegpt_file: Path) -> None:
    pairs = datasets.load_sharegpt(sharegpt_file)
    reqs = datasets.sample_sharegpt(pairs, 7, _count_words, seed=1, output_len=3)
    assert len(reqs) == 7
    # a fixed output length skips the reply check: tiny-reply is kept, short is not.
    assert {r.prompt_len for r in reqs} == {7, 11, 21}
    assert {r.expected_output_len for r in reqs} == {3}
    assert reqs[3:6] == reqs[0:3]  # fewer valid conversations than requested: cycled
