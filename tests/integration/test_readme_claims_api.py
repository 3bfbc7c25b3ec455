"""README claims about `kvflow serve`'s HTTP API, against one real server started with
`--api-key` and `--max-model-len` (prefix caching is on by default):

- `--api-key`: 401 in OpenAI's error shape without or with a wrong key; /health and
  /metrics stay open (as in vLLM), every other route needs the key;
- it binds 127.0.0.1 unless `--host` says otherwise;
- `usage.prompt_tokens_details.cached_tokens` and `kvflow:prefix_cache_hits_total`
  report real prefix-cache hits, and a hit changes no output;
- `echo`, a list of prompts (strings or token ids), chat `top_logprobs`, `n` > 1;
- `--max-model-len` caps the context: a longer prompt gets a 400;
- Ctrl-C (SIGINT to the whole process group) stops every process cleanly.

Greedy texts are compared across batch shapes (a prefix-cache hit prefills fewer rows,
a list of prompts prefills them together), which take different float32 kernel routes
(kernels/cpu/linear.py) and so sum in different orders. Equality still holds because
the tiny model's greedy choices are far from ties: `assert_clear_greedy` checks that
the top-1 logprob beats the top-2 by over 1e-3 at every step, while the routes differ
by about 1e-6.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    MODEL_NAME,
    Server,
    group_members,
    listening_addresses,
    metric_values,
    sse_events,
    start_server,
    stop_server,
    wait_for,
)

from kvflow import LLM, SamplingParams
from kvflow.outputs import RequestOutput

pytestmark = pytest.mark.slow

API_KEY = "test-key-" + uuid.uuid4().hex[:8]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256  # the tiny model's own context is 512
BLOCK_SIZE = 16  # the default
MIN_MARGIN = 1e-3
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("serve")
    extra = ["--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN)]
    srv = start_server(tiny_model_dir, log_dir, *extra)  # no --host: the default
    yield srv
    stop_server(srv)  # a no-op after test_ctrl_c_stops_every_process


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    """The same model in-process, prefix caching off."""
    return LLM(
        str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_blocks=64,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
    )


def post(server: Server, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", AUTH)
    return httpx.post(server.base_url + path, json=body, timeout=60.0, **kwargs)


def complete(server: Server, **body: Any) -> dict[str, Any]:
    reply = post(server, "/v1/completions", {"model": MODEL_NAME, **body})
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def assert_clear_greedy(outputs: list[RequestOutput]) -> None:
    """Every greedy step's winner leads the runner-up by more than MIN_MARGIN (outputs
    generated with logprobs >= 1, so each step has the top-2)."""
    for output in outputs:
        for completion in output.outputs:
            assert completion.logprobs is not None
            for step in completion.logprobs:
                best, second = sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                assert best - second > MIN_MARGIN, (output.prompt, best, second)


def offline_texts(offline: LLM, prompts: list[Any], max_tokens: int) -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, logprobs=2, **GREEDY)
    outputs = offline.generate(prompts, params)
    assert_clear_greedy(outputs)
    return [output.outputs[0].text for output in outputs]


# ---- --api-key ------------------------------------------------------------------------

COMPLETION_ROUTES = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ),
]


@pytest.mark.parametrize(("path", "body"), COMPLETION_ROUTES, ids=["completions", "chat"])
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
    ids=["no-key", "wrong-key", "no-bearer"],
)
def test_api_key_is_required(
    server: Server, path: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    reply = post(server, path, body, headers=headers)
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]  # OpenAI's shape, which its client parses
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert "API key" in error["message"]


@pytest.mark.parametrize(("path", "body"), COMPLETION_ROUTES, ids=["completions", "chat"])
def test_api_key_lets_requests_through(server: Server, path: str, body: dict[str, Any]) -> None:
    reply = post(server, path, body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("GET", "/openapi.json", None),
    ("POST", "/tokenize", {"model": MODEL_NAME, "prompt": "Hi"}),
    ("POST", "/detokenize", {"model": MODEL_NAME, "tokens": [19556]}),
]


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[g[1] for g in GUARDED])
def test_other_routes_need_the_key_too(
    server: Server, method: str, path: str, body: dict[str, Any] | None
) -> None:
    url = server.base_url + path
    assert httpx.request(method, url, json=body, timeout=10.0).status_code == 401
    assert httpx.request(method, url, json=body, headers=AUTH, timeout=10.0).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_stay_open(server: Server, path: str) -> None:
    assert httpx.get(server.base_url + path, timeout=10.0).status_code == 200


# ---- bind address -----------------------------------------------------------------------


def test_binds_loopback_by_default(server: Server) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    assert listening_addresses(port) == {"127.0.0.1"}
    assert f"at http://127.0.0.1:{port} " in server.log_path.read_text()


# ---- prefix caching -----------------------------------------------------------------------


def hits(server: Server) -> float:
    # A labelled counter has no sample before its first increment.
    return metric_values(server.base_url).get("kvflow:prefix_cache_hits_total", 0.0)


def test_prefix_cache_hits_are_reported_and_change_nothing(server: Server, offline: LLM) -> None:
    # Unique: no earlier request of this server shares its first block.
    prompt = f"Document {uuid.uuid4().hex}: " + " ".join(f"word{i}" for i in range(60))
    hits_before = hits(server)
    first = complete(server, prompt=prompt, max_tokens=8, **GREEDY)
    second = complete(server, prompt=prompt, max_tokens=8, **GREEDY)

    num_prompt = first["usage"]["prompt_tokens"]
    assert num_prompt > 4 * BLOCK_SIZE
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Whole blocks only, and at least the last prompt token is computed again.
    assert cached == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE, (cached, num_prompt)
    # The counter comes with the scheduler's stats (every ~0.5 s): wait for them.
    assert wait_for(
        lambda: hits(server) - hits_before >= cached,
        10.0,
    ), metric_values(server.base_url)

    expected = offline_texts(offline, [prompt], 8)[0]  # prefix caching off
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == expected


# ---- completions and chat features ----------------------------------------------------------

PROMPTS = ["The capital of France is", "Once upon a time, in a land"]


def test_echo_returns_the_prompt_before_the_completion(server: Server) -> None:
    plain = complete(server, prompt=PROMPTS[0], max_tokens=6, **GREEDY)["choices"][0]
    echoed = complete(server, prompt=PROMPTS[0], max_tokens=6, echo=True, logprobs=1, **GREEDY)
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPTS[0] + plain["text"]
    logprobs = choice["logprobs"]
    num_prompt = echoed["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == num_prompt + 6
    assert "".join(logprobs["tokens"][:num_prompt]) == PROMPTS[0]
    assert logprobs["token_logprobs"][0] is None  # the first prompt token has no logprob
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])


def test_a_list_of_prompts_as_strings_or_token_ids(server: Server, offline: LLM) -> None:
    expected = offline_texts(offline, PROMPTS, 8)
    by_text = complete(server, prompt=PROMPTS, max_tokens=8, **GREEDY)
    ids = [
        post(server, "/tokenize", {"model": MODEL_NAME, "prompt": p}).json()["tokens"]
        for p in PROMPTS
    ]
    by_ids = complete(server, prompt=ids, max_tokens=8, **GREEDY)
    for reply in (by_text, by_ids):
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1]
        assert [c["text"] for c in choices] == expected
        assert reply["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
        assert reply["usage"]["completion_tokens"] == 16


def test_chat_top_logprobs(server: Server) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 3,
        **GREEDY,
    }
    reply = post(server, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 3
        assert top[0]["token"] == entry["token"]  # greedy: the chosen one is the best
        assert top[0]["logprob"] == entry["logprob"] == max(t["logprob"] for t in top)
        assert bytes(entry["bytes"]).decode(errors="replace") == entry["token"]


def test_n_samples_over_http(server: Server) -> None:
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 7}
    reply = complete(server, **body, ignore_eos=True)
    choices = reply["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    assert len({c["text"] for c in choices}) > 1  # samples seeded 7, 8, 9 differ
    usage = reply["usage"]
    assert usage["completion_tokens"] == 18
    assert usage["prompt_tokens"] == len(
        post(server, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPTS[1]}).json()["tokens"]
    )  # the prompt counts once, however many samples
    assert complete(server, **body, ignore_eos=True)["choices"] == choices  # seeded

    events: list[Any] = []
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        json={"model": MODEL_NAME, **body, "ignore_eos": True, "stream": True},
        headers=AUTH,
        timeout=60.0,
    ) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    texts = {i: "" for i in range(3)}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {c["index"]: c["text"] for c in choices}


# ---- --max-model-len ----------------------------------------------------------------------


def test_max_model_len_caps_the_context(server: Server) -> None:
    fits = complete(server, prompt=[5] * (MAX_MODEL_LEN - 8), max_tokens=8, **GREEDY)
    assert fits["usage"]["completion_tokens"] == 8
    for prompt, max_tokens in (([5] * (MAX_MODEL_LEN + 10), 4), ([5] * (MAX_MODEL_LEN - 8), 9)):
        reply = post(
            server,
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens},
        )
        assert reply.status_code == 400, reply.text  # the model alone would take 512
        assert str(MAX_MODEL_LEN) in reply.json()["error"]["message"]


# ---- Ctrl-C: runs last, it stops the module's server ----------------------------------------


def test_ctrl_c_stops_every_process(server: Server) -> None:
    members = group_members(server.pid)
    assert len(members) >= 4  # launcher + worker + scheduler + detokenizer
    events: list[Any] = []
    streaming = threading.Event()

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 200, **GREEDY}
        with httpx.stream(
            "POST",
            server.base_url + "/v1/completions",
            json={**body, "stream": True},
            headers=AUTH,
            timeout=60.0,
        ) as response:
            for event in sse_events(response):
                events.append(event)
                streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(30.0)
    os.killpg(server.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process
    code = server.process.wait(30.0)
    reader.join(30.0)
    assert not reader.is_alive()
    assert events[-1] == "[DONE]"  # the stream ended (finished, or with an error event)
    assert wait_for(lambda: group_members(server.pid) == [], 10.0), group_members(server.pid)
    assert code == 0, server.log_tail()
    assert "Traceback" not in server.log_path.read_text(), server.log_tail()
