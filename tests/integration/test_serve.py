"""`kvflow serve` for real: OpenAI client against frontend + scheduler + worker +
detokenizer processes over ZeroMQ, compared with the offline `kvflow.LLM`.

Exact text equality with the offline engine, two ways (float32 throughout):
- one request at a time on both sides (`offline_alone`): the same batch shapes take the
  same CPU kernel routes (kernels/cpu/linear.py picks by row count), so the server
  repeats the offline computation exactly;
- 64 concurrent streams against one offline batch of 64: the server's batches are
  whatever the scheduler formed as requests arrived, so the routes (native <= 8 rows,
  oneDNN above) and summation orders differ, by up to 6e-6 in a logprob (measured).
  Greedy tokens still agree because the tiny model's choices are far from ties:
  `offline_texts` checks that every step's winner leads by more than MIN_MARGIN.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_harness import ENGINE_ARGS, MODEL_NAME, Server, metric_values, wait_for

from kvflow import LLM, SamplingParams
from kvflow.outputs import RequestOutput

pytestmark = pytest.mark.slow

# Random weights rarely sample EOS, but "rarely" is not "never": make lengths exact.
NO_EOS = {"ignore_eos": True}
PROMPTS = [
    f"Request number {i}: tell me about the color {c}"
    for i, c in enumerate(["red", "green", "blue", "cyan"] * 16)
]


def _option(name: str) -> str:
    return ENGINE_ARGS[ENGINE_ARGS.index(name) + 1]


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(
        str(tiny_model_dir),
        dtype=_option("--dtype"),
        device=_option("--device"),
        num_blocks=int(_option("--num-blocks")),
    )


MIN_MARGIN = 1e-4  # logprob lead of every greedy choice: >15x the routes' differences
GREEDY_12 = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def assert_clear_greedy(output: RequestOutput) -> None:
    for step in output.outputs[0].logprobs or []:
        best, second = sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
        assert best - second > MIN_MARGIN, (output.prompt, best, second)


@pytest.fixture(scope="module")
def offline_texts(offline: LLM) -> list[str]:
    """The 64 prompts as one offline batch (margins checked: see the module docstring)."""
    outputs = offline.generate(PROMPTS, GREEDY_12)
    for output in outputs:
        assert_clear_greedy(output)
    return [output.outputs[0].text for output in outputs]


def offline_alone(offline: LLM, prompt: str, params: SamplingParams) -> str:
    """One prompt alone: the batch shapes of a lone request to the server."""
    return offline.generate([prompt], params)[0].outputs[0].text


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def metrics(server: Server) -> dict[str, float]:
    """Sample name -> value of the engine gauges (labels dropped: one model, one engine)."""
    return metric_values(server.base_url)


def test_health_and_models(server: Server, client: openai.OpenAI) -> None:
    assert httpx.get(server.base_url + "/health", timeout=5.0).status_code == 200
    assert [model.id for model in client.models.list()] == [MODEL_NAME]


def test_completion_matches_offline_greedy(client: openai.OpenAI, offline: LLM) -> None:
    for prompt in PROMPTS[:3]:
        expected = offline_alone(offline, prompt, GREEDY_12)
        completion = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0.0, extra_body=NO_EOS
        )
        choice = completion.choices[0]
        assert (choice.text, choice.finish_reason) == (expected, "length")
        assert completion.usage is not None and completion.usage.completion_tokens == 12


def test_streaming_completion_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0.0,
        extra_body=NO_EOS,
    )
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == full
    assert finish[-1] == "length" and set(finish[:-1]) <= {None}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_chat_streaming_and_not(client: openai.OpenAI, offline: LLM) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ]
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0.0, extra_body=NO_EOS
    )
    reply = client.chat.completions.create(**kwargs)
    content = reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    expected = offline.chat(
        messages, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    assert content == expected[0].outputs[0].text
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices
    )
    assert streamed == content


def test_64_concurrent_streams_each_get_their_own_tokens(
    server: Server, offline_texts: list[str]
) -> None:
    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[str | None]]:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            stream=True,
            extra_body=NO_EOS,
        )
        pieces, finishes = [], []
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finishes.append(chunk.choices[0].finish_reason)
        return "".join(pieces), finishes

    async def run_all() -> list[tuple[str, list[str | None]]]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0
        ) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in PROMPTS))

    start = time.monotonic()
    results = asyncio.run(run_all())
    server.timings["64 streams"] = time.monotonic() - start
    assert len(PROMPTS) == 64
    for (text, finishes), expected in zip(results, offline_texts):
        assert text == expected
        assert finishes[-1] == "length"
    assert len(set(offline_texts)) > 1  # distinct prompts really diverge


def _running_with_blocks(values: dict[str, float]) -> bool:
    return values["kvflow:num_requests_running"] == 1.0 and values["kvflow:kv_cache_usage_perc"] > 0


def test_client_disconnect_frees_kv_blocks(server: Server) -> None:
    assert wait_for(lambda: metrics(server)["kvflow:kv_cache_usage_perc"] == 0.0, 5.0)
    body = {
        "model": MODEL_NAME,
        "prompt": "A very long story:",
        "max_tokens": 480,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30.0) as http,
        http.stream("POST", server.base_url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(4):  # a few events: the request is running
            next(lines)
        # The engine's gauges arrive with its stats, every 0.5 s: wait for a tick that
        # sees the request running and holding blocks, both from one scrape. 480
        # tokens take 0.8 s or more here, so a tick falls inside the request.
        busy = wait_for(lambda: _running_with_blocks(metrics(server)), 5.0)
        # Leaving the block closes the connection mid-stream.
    assert busy, "no stats tick saw the request running (it finished first?)"
    freed = wait_for(
        lambda: (
            metrics(server)["kvflow:kv_cache_usage_perc"] == 0.0
            and metrics(server)["kvflow:num_requests_running"] == 0.0
        ),
        10.0,
    )
    assert freed, metrics(server)


def test_prompt_longer_than_context_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=[5] * 600, max_tokens=4)
    # The engine is still fine afterwards.
    ok = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


def test_stop_string_ends_the_request_like_offline(
    server: Server, client: openai.OpenAI, offline: LLM
) -> None:
    full = offline_alone(offline, PROMPTS[5], GREEDY_12)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a piece from the middle
    expected = offline.generate(
        [PROMPTS[5]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[5],
        max_tokens=12,
        temperature=0.0,
        stop=[stop],
        extra_body=NO_EOS,
    )
    choice = completion.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, "stop")
    assert stop not in choice.text and full.startswith(choice.text)
    # The detokenizer told the scheduler to stop: nothing keeps running.
    assert wait_for(lambda: metrics(server)["kvflow:num_requests_running"] == 0.0, 5.0)


def test_logprobs_carry_token_strings(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[7],
        max_tokens=6,
        temperature=0.0,
        logprobs=3,
        extra_body=NO_EOS,
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None
    tokens, top = choice.logprobs.tokens or [], choice.logprobs.top_logprobs or []
    assert len(tokens) == len(top) == 6
    for token, alternatives in zip(tokens, top):
        assert token in alternatives  # greedy: the chosen token is the most likely
        assert len(alternatives) == 3
        assert max(alternatives.values()) == alternatives[token]
