"""A real `kvflow serve` (tiny random model) under hostile and careless clients:

- an abort soak: 1,000 streams, most of them dropped at a random moment (before the
  first byte, after some chunks); afterwards no KV block is in use, the scheduler's
  integrity check (run whenever the engine is idle) has passed, and fresh greedy
  requests return exactly the tokens they returned before the soak;
- schemathesis over /openapi.json: more than 1,000 generated requests, valid and
  invalid, and not one answered with a status >= 500; and over the pooling routes
  (/v1/embeddings, /pooling) of a `--runner pooling` server the same.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import MODEL_NAME, Server, metric_values, start_server, stop_server, wait_for

pytestmark = pytest.mark.slow

SOAK_STREAMS = 1000
SOAK_CONCURRENCY = 64
SCHEMA_CASES_PER_BODY_ROUTE = 255  # x 7 routes with a body, + the GET routes
MAX_TOKENS_CAP = 2  # generated requests stay cheap (a null max_tokens fills the context)
MAX_N_CAP = 2
MAX_PROMPTS = 2
# One torch thread: on 2 shared cores the frontend, the test's client and the worker's
# spinning threads contend, and a step then takes ~100 ms instead of ~5.
ONE_THREAD = ("--num-threads", "1")


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("robust"), *ONE_THREAD)
    yield server
    code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()


def greedy(server: Server, prompt: str, max_tokens: int) -> tuple[str, int]:
    request = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    r = httpx.post(server.base_url + "/v1/completions", json=request, timeout=120.0)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


def engine_idle(server: Server) -> bool:
    values = metric_values(server.base_url)
    return (
        values["kvflow:kv_cache_usage_perc"] == 0.0
        and values["kvflow:num_requests_running"] == 0.0
        and values["kvflow:num_requests_waiting"] == 0.0
    )


# --- abort soak ---------------------------------------------------------------------------


async def _one_stream(client: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    """One stream, read to the end or dropped: how it ended."""
    fate = rng.random()
    request = {
        "model": MODEL_NAME,
        "prompt": f"soak {rng.randrange(10**6)}",
        "max_tokens": rng.randint(1, 16),
        "ignore_eos": True,
        "stream": True,
        "n": rng.choice([1, 1, 1, 1, 2]),
    }
    if fate < 0.2:  # dropped at a random instant: before the status line, or after
        try:
            await asyncio.wait_for(client.post(url, json=request), rng.uniform(0.0, 0.05))
            return "finished"
        except asyncio.TimeoutError:
            return "dropped"
    drop_after = rng.randint(0, 8) if fate < 0.6 else None
    async with client.stream("POST", url, json=request) as response:
        assert response.status_code == 200, await response.aread()
        chunks = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[len("data: ") :]), line
                chunks += 1
                if drop_after is not None and chunks > drop_after:
                    return "dropped"  # leaving the block closes the connection
    return "finished"


async def _soak(url: str) -> dict[str, int]:
    rng = random.Random(19)
    limit = asyncio.Semaphore(SOAK_CONCURRENCY)
    limits = httpx.Limits(max_connections=SOAK_CONCURRENCY * 2)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:

        async def guarded() -> str:
            async with limit:
                return await _one_stream(client, url, rng)

        fates = await asyncio.gather(*(guarded() for _ in range(SOAK_STREAMS)))
    return {fate: fates.count(fate) for fate in set(fates)}


def test_abort_soak_leaks_nothing(srv: Server) -> None:
    prompts = [("The soak begins", 24), ("Another prompt", 9), ("x", 40)]
    before = [greedy(srv, prompt, n) for prompt, n in prompts]
    assert [count for _, count in before] == [n for _, n in prompts]
    fates = asyncio.run(_soak(srv.base_url + "/v1/completions"))
    assert sum(fates.values()) == SOAK_STREAMS
    assert fates.get("dropped", 0) >= SOAK_STREAMS // 3, fates
    assert fates.get("finished", 0) >= SOAK_STREAMS // 4, fates
    # No block in use, nothing running or waiting; then two idle integrity checks
    # (every second) pass: a failed one would end the scheduler and /health.
    assert wait_for(lambda: engine_idle(srv), 30.0), metric_values(srv.base_url)
    time.sleep(2.5)
    assert httpx.get(srv.base_url + "/health", timeout=5.0).status_code == 200
    after = [greedy(srv, prompt, n) for prompt, n in prompts]
    assert after == before


# --- schemathesis -------------------------------------------------------------------------


def _cheap(case: Any) -> Any:
    """Cap what makes a generated request expensive (tokens to generate, samples)."""
    body = case.body
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(field)
            if field in body and (value is None or (isinstance(value, int) and value > 2)):
                body[field] = MAX_TOKENS_CAP
        if "max_tokens" not in body:  # defaults: 16, or the whole context for chat
            body["max_tokens"] = MAX_TOKENS_CAP
        if "input" in body and "max_output_tokens" not in body:  # /v1/responses: the context
            body["max_output_tokens"] = MAX_TOKENS_CAP
        if isinstance(body.get("n"), int) and body["n"] > MAX_N_CAP:
            body["n"] = MAX_N_CAP
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > MAX_PROMPTS:
            body["prompt"] = body["prompt"][:MAX_PROMPTS]  # each listed prompt is a request
    return case


def _schemathesis(
    server: Server, cases_per_body_route: int, cheap: Any, paths: set[str] | None = None
) -> tuple[list[tuple[str, int]], list[str]]:
    """(route, status) of every generated request to the server's routes (those of
    `paths` only, if given), and a description of each answered with a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    seen: list[tuple[str, int]] = []
    errors: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if paths is not None and operation.path not in paths:
            continue
        has_body = bool(operation.body)
        strategy = st.one_of(*(operation.as_strategy(generation_mode=m) for m in modes))

        @settings(
            max_examples=cases_per_body_route if has_body else 5,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy.map(cheap))
        def check(case: Any) -> None:
            response = case.call(base_url=server.base_url, timeout=120)
            seen.append((case.operation.label, response.status_code))
            if response.status_code >= 500:
                errors.append(
                    f"{response.status_code} {response.text[:300]}\n{case.as_curl_command()}"
                )

        check()
    return seen, errors


def test_schemathesis_finds_no_server_error(srv: Server) -> None:
    seen, errors = _schemathesis(srv, SCHEMA_CASES_PER_BODY_ROUTE, _cheap)
    routes = {label for label, _ in seen}
    assert len(seen) >= 1000 and len(routes) >= 8, (len(seen), routes)
    assert errors == [], "\n\n".join(errors[:5])
    statuses = {status for _, status in seen}
    assert 200 in statuses and 400 in statuses, statuses
    assert wait_for(lambda: engine_idle(srv), 30.0)


POOLING_PATHS = {"/v1/embeddings", "/pooling"}


def _cheap_inputs(case: Any) -> Any:
    """At most MAX_PROMPTS inputs a request (each is an engine request)."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("input"), list):
        body["input"] = body["input"][:MAX_PROMPTS]
    return case


def test_schemathesis_pooling_routes_on_a_pooling_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same, on `--runner pooling`: its routes run real engine requests."""
    flags = ("--runner", "pooling", *ONE_THREAD)
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("robust-pooling"), *flags)
    try:
        seen, errors = _schemathesis(
            server, SCHEMA_CASES_PER_BODY_ROUTE, _cheap_inputs, POOLING_PATHS
        )
        assert {label.split(" ", 1)[1] for label, _ in seen} == POOLING_PATHS
        assert errors == [], "\n\n".join(errors[:5])
        statuses = {status for _, status in seen}
        assert 200 in statuses and 400 in statuses, statuses
        assert wait_for(lambda: engine_idle(server), 30.0)
    finally:
        code, survivors = stop_server(server)
    assert code == 0 and survivors == [], server.log_tail()
