"""`kvflow serve` and the offline `LLM` run one engine core: the same tokens on a mixed
workload, with steps in flight (async scheduling) on both.

The workload has chunked prefills (a 32-token budget), prefix-cache hits (prompts that
share their first blocks), preemptions (18 blocks of 4 tokens for ~300 tokens of
demand), stop strings, n > 1 and seeded sampling. Over HTTP the requests arrive
concurrently, so batches, preemptions and chunk boundaries differ from the offline
run's; outputs must not. Why exact equality holds: float32 on a tiny model whose
logits are peaky (tests/conftest.py) makes greedy choices far from ties, and a seeded
request's draws depend only on its seed and how many tokens it has sampled
(request_generator), never on the batch or on being preempted.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    Server,
    metric_values,
    start_server,
    stop_server,
    wait_for,
)

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

ENGINE = ["--num-blocks", "18", "--block-size", "4", "--max-num-batched-tokens", "32"]
SHARED_PREFIX = list(range(300, 316))  # 4 full blocks shared by half of the prompts


def _prompt(i: int) -> list[int]:
    own = [1000 + 37 * i + k for k in range(6 + 3 * (i % 4))]
    return SHARED_PREFIX + own if i % 2 == 0 else own + list(range(500 + i, 510 + i))


def _params(i: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 10 + 2 * (i % 5), "ignore_eos": True}
    if i % 3 == 1:
        params.update(temperature=0.9, top_p=0.95, seed=1000 + i)
    else:
        params.update(temperature=0.0)
    if i % 4 == 3:
        params.update(n=2, temperature=0.8, seed=77 + i)
    if i % 5 == 2:
        params.update(stop=[" the", "ing"])
    return params


WORKLOAD = [(_prompt(i), _params(i)) for i in range(10)]


@pytest.fixture(scope="module")
def async_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("served-equals-offline")
    server = start_server(tiny_model_dir, log_dir, *ENGINE, "--async-scheduling")
    yield server
    stop_server(server)


def _served(server: Server, prompt: list[int], params: dict[str, Any]) -> list[str]:
    body = {"model": MODEL_NAME, "prompt": prompt, **params}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices]


def offline_llm(model_dir: Path, async_scheduling: bool) -> LLM:
    """The offline engine with the served engine's options (ENGINE)."""
    return LLM(
        str(model_dir),
        dtype="float32",
        num_blocks=18,
        block_size=4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )


def test_served_and_offline_give_the_same_outputs(async_server: Server, tiny_model_dir: Path):
    with ThreadPoolExecutor(len(WORKLOAD)) as pool:
        served = list(pool.map(lambda w: _served(async_server, *w), WORKLOAD))
    llm = offline_llm(tiny_model_dir, async_scheduling=True)
    outputs = llm.generate([p for p, _ in WORKLOAD], [SamplingParams(**p) for _, p in WORKLOAD])
    offline = [[o.text for o in output.outputs] for output in outputs]
    assert served == offline
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.prefix_cache_hits > 0
    # The served run preempted too (~300 tokens of demand for 72 slots), and it shows.
    preempted = lambda: metric_values(async_server.base_url).get(  # noqa: E731
        "kvflow:num_preemptions_total", 0.0
    )
    assert wait_for(lambda: preempted() > 0, timeout_s=10.0)
    # Stop strings were met and held back; n=2 samples differ from each other.
    assert any(
        p.get("stop") and o.outputs[0].finish_reason == "stop"
        for (_, p), o in zip(WORKLOAD, outputs)
    )
    assert all(len(set(texts)) == 2 for (_, p), texts in zip(WORKLOAD, offline) if p.get("n") == 2)


def test_async_offline_equals_sync_offline(tiny_model_dir: Path) -> None:
    prompts = [p for p, _ in WORKLOAD]
    params = [SamplingParams(**p) for _, p in WORKLOAD]
    results = {}
    for flag in (False, True):
        llm = offline_llm(tiny_model_dir, async_scheduling=flag)
        outs = llm.generate(prompts, params)
        results[flag] = [
            [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in outs
        ]
        assert llm.engine.scheduler.num_preemptions > 0
        llm.engine.kv_cache.check_integrity()
        assert llm.engine.kv_cache.num_free_blocks == 18
    assert results[True] == results[False]
    for (_, p), outs in zip(WORKLOAD, results[True]):
        for token_ids, _, reason, _ in outs:  # exactly max_tokens, or stopped earlier
            assert len(token_ids) == p["max_tokens"] or reason == "stop"
