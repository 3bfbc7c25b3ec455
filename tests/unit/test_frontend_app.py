"""The frontend app against a fake engine over the real ZeroMQ sockets.

`FakeEngine` binds what the scheduler and the detokenizer bind (scheduler_input PULL,
stats PUB, frontend_output ROUTER) on ipc sockets in a tmp dir, and answers each
AddRequest with a canned delta sequence, so EngineClient runs for real. The app runs
in a real uvicorn server (on uvloop, via `main.serve`) on 127.0.0.1 with a free port.

Canned output of one sample: the pieces "[<prompt len>/<sample index>]", " hello",
" world" as tokens 101, 102, 103, cut to max_tokens (finish "length") or all three
(finish "stop"). Prompts starting with "hang" get one piece and then nothing more.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
import zmq
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.engine import AbortRequests, AddRequest
from kvflow.proto.frontend import EngineDead, FrontendOutputs, RequestOutputDelta
from kvflow.proto.stats import SchedulerStats
from kvflow.proto.step import TokenLogprobs
from kvflow.runtime.sockets import TypedSocket
from kvflow.services.frontend.app import FrontendConfig, build_app
from kvflow.services.frontend.engine_client import EngineClient
from kvflow.services.frontend.main import serve
from kvflow.services.frontend.metrics import FrontendMetrics

MODEL = "tiny-test"
MAX_MODEL_LEN = 64
VOCAB_SIZE = 300
PIECES = [" hello", " world"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token per byte, plus ChatML specials."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHATML
    )


TOKENIZER = tiny_tokenizer()
QUESTION_MARK = TOKENIZER.encode("?")[0]


# --- fake engine ---------------------------------------------------------------------

# How long a test waits for something that must happen soon. Generous, for a loaded
# 2-core machine: a test waits on the condition itself, so a working path takes
# milliseconds, and a broken one fails when the deadline passes.
WAIT_S = 30.0


class FakeEngine:
    """Scheduler + detokenizer stand-in, run in its own thread with blocking zmq."""

    def __init__(self, addresses: ServiceAddresses) -> None:
        self.added: list[AddRequest] = []
        self.aborted: list[str] = []
        self.publish_stats = True
        self.hang_prefix = TOKENIZER.encode("hang")
        self.refusal: tuple[str, str] | None = None  # (code, message): refuse every request
        self.silent = False  # answer nothing (a request stuck in the queue)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._frontends: set[bytes] = set()
        self._stats_count = 0
        self._context = zmq.Context()
        self._pull = TypedSocket.open(
            self._context,
            zmq.PULL,
            addresses.scheduler_input,
            bind=True,
            recv_type=AddRequest | AbortRequests,
        )
        self._router = TypedSocket.open(
            self._context, zmq.ROUTER, addresses.frontend_output, bind=True
        )
        self._pub = TypedSocket.open(self._context, zmq.PUB, addresses.stats, bind=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def kill(self, reason: str) -> None:
        """EngineDead on the stats channel, as the scheduler sends it."""
        self._commands.put(lambda: self._pub.send(EngineDead(reason)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in (self._pull, self._router, self._pub):
            sock.close()
        self._context.term()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out waiting for the fake engine"
            time.sleep(0.01)

    def _run(self) -> None:
        next_stats = 0.0
        while not self._stop.is_set():
            message = self._pull.recv(timeout_ms=10)
            if isinstance(message, AddRequest):
                self.added.append(message)
                self._answer(message)
            elif isinstance(message, AbortRequests):
                self.aborted.extend(message.req_ids)
            while not self._commands.empty():
                self._commands.get()()
            if self.publish_stats and time.monotonic() >= next_stats:
                next_stats = time.monotonic() + 0.1
                self._pub.send(self._stats())

    def _stats(self) -> SchedulerStats:
        self._stats_count += 1
        k = self._stats_count
        return SchedulerStats(
            timestamp=time.time(),
            engine="0",
            num_running=1,
            num_waiting=2,
            kv_cache_usage=0.25,
            prefix_cache_queries=10 * k,
            prefix_cache_hits=4 * k,
            num_preemptions=k,
            num_prompt_tokens=7 * k,
            num_generation_tokens=3 * k,
            num_steps=2 * k,
            step_tokens=[1, 20],
        )

    def _answer(self, add: AddRequest) -> None:
        if self.silent:
            return
        if self.refusal is not None:
            code, error = self.refusal
            delta = RequestOutputDelta(
                add.req_id, "", [], finish_reason="error", error=error, error_code=code
            )
            self._router.send(FrontendOutputs([delta]), to=add.frontend_id.encode())
            return
        params = add.sampling_params
        prompt = add.prompt_token_ids
        index = int(add.req_id.rpartition("#")[2]) if "#" in add.req_id else 0
        pieces = [f"[{len(prompt)}/{index}]", *PIECES]
        hang = prompt[: len(self.hang_prefix)] == self.hang_prefix
        max_tokens = params.max_tokens or len(pieces)
        cut = 1 if hang else min(max_tokens, len(pieces))
        finish = None if hang else ("length" if max_tokens <= len(pieces) else "stop")
        for i, piece in enumerate(pieces[:cut]):
            last = i == cut - 1
            delta = self._delta(add, i, piece, finish if last else None)
            self._router.send(FrontendOutputs([delta]), to=add.frontend_id.encode())

    def _delta(self, add: AddRequest, i: int, piece: str, finish: str | None) -> RequestOutputDelta:
        params, prompt = add.sampling_params, add.prompt_token_ids
        delta = RequestOutputDelta(
            req_id=add.req_id,
            text=piece,
            token_ids=[101 + i],
            finish_reason=finish,
            stop_reason=2 if finish == "stop" else None,
            num_prompt_tokens=len(prompt),
            num_cached_tokens=min(len(prompt), 4),
            num_output_tokens=i + 1,
            queued_time=add.arrival_time + 0.001,
            scheduled_time=add.arrival_time + 0.002,
            first_token_time=add.arrival_time + 0.003,
        )
        if params.logprobs is not None:
            alts = list(range(200, 200 + params.logprobs))
            delta.logprobs = [
                TokenLogprobs([101 + i, *alts], [-0.5, *(-1.0 - j for j in range(len(alts)))], 1)
            ]
            delta.logprob_tokens = [[piece, *(f"alt{j}" for j in range(len(alts)))]]
        if params.prompt_logprobs is not None and i == 0:
            # No token strings: the frontend must decode them itself.
            delta.prompt_logprobs = [
                TokenLogprobs([tok, QUESTION_MARK], [-2.0, -3.0], 2) for tok in prompt[1:]
            ]
        return delta


# --- server harness --------------------------------------------------------------------


@dataclass
class Harness:
    url: str
    fake: FakeEngine
    client: EngineClient
    server: uvicorn.Server
    thread: threading.Thread
    metrics: FrontendMetrics
    opened_after_s: float  # from the start of serve() to its port accepting requests
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs)

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(10)
        self.fake.close()


def start_harness(
    tmp: Path, watchdog: Any = None, stats_from_s: float | None = 0.0, **overrides: Any
) -> Harness:
    """`stats_from_s`: the fake engine's first stats go out this long after the start
    (None: only when the test turns them on)."""
    addresses = ServiceAddresses.ipc(str(tmp))
    fake = FakeEngine(addresses)
    fake.publish_stats = stats_from_s == 0.0
    if stats_from_s:
        threading.Timer(stats_from_s, lambda: setattr(fake, "publish_stats", True)).start()
    config = FrontendConfig(
        served_model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB_SIZE,
        port=0,
        **{"max_body_bytes": 64 * 1024, "shutdown_grace_s": 0.3, **overrides},
    )
    client = EngineClient(
        addresses,
        config.frontend_id,
        stats_timeout_s=config.stats_timeout_s,
        watchdog=watchdog,
        resend_wait_s=config.resend_wait_s,
    )
    metrics = FrontendMetrics(MODEL, MAX_MODEL_LEN)
    app = build_app(config, client, TOKENIZER, metrics)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    ready = threading.Event()

    def run() -> None:
        import uvloop

        uvloop.run(serve(server, client, config.shutdown_grace_s, ready.set))

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(15), "the server did not start"
    opened_after_s = time.monotonic() - start
    port = server.servers[0].sockets[0].getsockname()[1]
    # No wait for the engine's health here: serve() opens the port only once it serves.
    return Harness(
        f"http://127.0.0.1:{port}", fake, client, server, thread, metrics, opened_after_s
    )


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    harness = start_harness(tmp_path_factory.mktemp("ipc"))
    yield harness
    harness.stop()


@pytest.fixture
def own(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    started: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        started.append(start_harness(tmp_path, **kwargs))
        return started[-1]

    yield make
    for harness in started:
        harness.stop()


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Decoded `data:` payloads of an SSE body; [DONE] stays the string "[DONE]"."""
    events: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(h: Harness, path: str, body: dict[str, Any]) -> list[Any]:
    with h.http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def ids(text: str) -> list[int]:
    return list(TOKENIZER.encode(text))


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """ChatML rendered by hand: the template's output, tokenized without extra specials."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return list(TOKENIZER.encode(text + "<|im_start|>assistant\n", add_special_tokens=False))


# --- completions -----------------------------------------------------------------------


def test_completion_non_streaming(h: Harness) -> None:
    before = len(h.fake.added)
    r = h.post("/v1/completions", {"model": MODEL, "prompt": "Hi there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "text": "[8/0] hello world",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 8,
        "completion_tokens": 3,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    (add,) = h.fake.added[before:]
    assert add.prompt_token_ids == ids("Hi there")
    assert add.sampling_params.max_tokens == 3
    assert add.frontend_id == h.client.frontend_id


def test_unknown_fields_are_named_in_a_header_and_the_request_still_runs(h: Harness) -> None:
    body = {"prompt": "Hi", "max_tokens": 1, "frobnicate": 1, "zz_extra": {"a": 2}}
    r = h.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvflow-ignored-fields"] == "frobnicate,zz_extra"
    chat = {"messages": MESSAGES, "max_completion_tokens": 1, "frobnicate": True}
    r = h.post("/v1/chat/completions", chat)
    assert r.status_code == 200 and r.headers["x-kvflow-ignored-fields"] == "frobnicate"
    r = h.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert "x-kvflow-ignored-fields" not in r.headers


def test_return_token_ids_and_truncate_prompt_tokens(h: Harness) -> None:
    before = len(h.fake.added)
    body = {"prompt": "Hi there", "max_tokens": 3, "return_token_ids": True}
    r = h.post("/v1/completions", {**body, "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["prompt_token_ids"] == ids("Hi there")[-5:]
    assert choice["token_ids"] == [101, 102, 103]
    (add,) = h.fake.added[before:]
    assert add.prompt_token_ids == ids("Hi there")[-5:]
    plain = h.post("/v1/completions", {"prompt": "Hi there", "max_tokens": 3}).json()
    assert "token_ids" not in plain["choices"][0]
    chat = {"messages": MESSAGES, "max_completion_tokens": 2, "return_token_ids": True}
    out = h.post("/v1/chat/completions", chat).json()
    assert out["prompt_token_ids"] == chat_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    )
    assert out["choices"][0]["token_ids"] == [101, 102]
    events = stream(h, "/v1/chat/completions", {**chat, "stream": True})
    streamed = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == [101, 102]


def test_completion_fills_context_when_max_tokens_is_null(h: Harness) -> None:
    before = len(h.fake.added)
    r = h.post("/v1/completions", {"prompt": "abcd", "max_tokens": None, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    (add,) = h.fake.added[before:]
    assert add.sampling_params.max_tokens == MAX_MODEL_LEN - 4
    assert add.sampling_params.temperature == 0.0


def test_completion_streaming_with_usage(h: Harness) -> None:
    body = {"prompt": "abc", "max_tokens": 10, "stream": True}
    events = stream(h, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(choice["text"] for c in chunks for choice in c["choices"])
    assert text == "[3/0] hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "stop"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_a_token_whose_text_is_held_back_is_still_a_chunk(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A delta with a token but no text yet (an incomplete character, a possible stop
    # string): a chunk of empty text, one per token, as vLLM streams (no parser).
    monkeypatch.setattr(sys.modules[__name__], "PIECES", [" hello", "", " world"])
    completion = stream(h, "/v1/completions", {"prompt": "abc", "stream": True})[:-1]
    assert [c["choices"][0]["text"] for c in completion] == ["[3/0]", " hello", "", " world"]
    chat = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    chunks = stream(h, "/v1/chat/completions", chat)[1:-1]  # after the role chunk
    contents = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert contents[1:] == [" hello", "", " world"]  # (the first: the prompt length)


def test_completion_streaming_without_usage(h: Harness) -> None:
    events = stream(h, "/v1/completions", {"prompt": "abc", "stream": True})
    assert events[-1] == "[DONE]"
    assert all(c["choices"] for c in events[:-1])


def test_n2_and_several_prompts_index_choices_like_openai(h: Harness) -> None:
    before = len(h.fake.added)
    r = h.post("/v1/completions", {"prompt": ["ab", "abcd"], "n": 2, "seed": 7, "max_tokens": 9})
    assert r.status_code == 200, r.text
    texts = {c["index"]: c["text"] for c in r.json()["choices"]}
    assert texts == {
        0: "[2/0] hello world",
        1: "[2/1] hello world",
        2: "[4/0] hello world",
        3: "[4/1] hello world",
    }
    assert r.json()["usage"]["prompt_tokens"] == 6
    assert r.json()["usage"]["completion_tokens"] == 12
    added = h.fake.added[before:]
    assert sorted(a.req_id.rpartition("-")[2] for a in added) == ["0#0", "0#1", "1#0", "1#1"]
    assert {(a.req_id[-1], a.sampling_params.seed, a.sampling_params.n) for a in added} == {
        ("0", 7, 1),
        ("1", 8, 1),
    }


def test_n2_streaming_chat(h: Harness) -> None:
    events = stream(
        h,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True},
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            by_index[choice["index"]] += choice["delta"].get("content", "")
    prompt_len = len(chat_ids([{"role": "user", "content": "x"}]))
    assert by_index == {i: f"[{prompt_len}/{i}] hello world" for i in (0, 1)}


def test_echo_with_logprobs(h: Harness) -> None:
    before = len(h.fake.added)
    r = h.post("/v1/completions", {"prompt": "abc", "echo": True, "logprobs": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == "abc[3/0] hello"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "[3/0]", " hello"]
    assert lp["token_logprobs"] == [None, -2.0, -2.0, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2, 3, 8]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"b": -2.0, "?": -3.0}
    assert lp["top_logprobs"][3] == {"[3/0]": -0.5, "alt0": -1.0, "alt1": -2.0}
    (add,) = h.fake.added[before:]
    assert add.sampling_params.logprobs == 2 and add.sampling_params.prompt_logprobs == 2


def test_streaming_echo_comes_first(h: Harness) -> None:
    events = stream(h, "/v1/completions", {"prompt": "xy", "echo": True, "stream": True})
    assert events[0]["choices"][0]["text"] == "xy[2/0]"


# --- chat --------------------------------------------------------------------------------


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
    },
]


def test_chat_non_streaming(h: Harness) -> None:
    before = len(h.fake.added)
    r = h.post(
        "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 3}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    expected_prompt = chat_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    )
    n = len(expected_prompt)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": f"[{n}/0] hello world"},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    (add,) = h.fake.added[before:]
    assert add.prompt_token_ids == list(expected_prompt)
    assert add.sampling_params.max_tokens == 3


def test_chat_streaming(h: Harness) -> None:
    events = stream(
        h,
        "/v1/chat/completions",
        {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    first, *middle, usage = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in middle).endswith(
        " hello world"
    )
    assert middle[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_chat_logprobs_shape(h: Harness) -> None:
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "max_tokens": 2}
    r = h.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content][1:] == [" hello"]
    assert content[1] == {
        "token": " hello",
        "logprob": -0.5,
        "bytes": list(b" hello"),
        "top_logprobs": [
            {"token": "alt0", "logprob": -1.0, "bytes": list(b"alt0")},
            {"token": "alt1", "logprob": -2.0, "bytes": list(b"alt1")},
        ],
    }


def test_chat_echo_continues_the_assistant_turn(h: Harness) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure:"}]
    body = {"messages": messages, "echo": True, "add_generation_prompt": False, "max_tokens": 1}
    r = h.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("Sure:[")


# --- the official client -------------------------------------------------------------


def test_openai_client(h: Harness) -> None:
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert completion.choices[0].text == "[5/0] hello world"
    assert completion.usage is not None and completion.usage.total_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.endswith(" hello world")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]


# --- bad input ---------------------------------------------------------------------------

LONG = "z" * (MAX_MODEL_LEN + 1)
BAD_INPUTS = [
    ("/v1/completions", b'{"prompt": ', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"{}", 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [VOCAB_SIZE]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [VOCAB_SIZE + 1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "abcd", "max_tokens": MAX_MODEL_LEN - 3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(a"}, 400, "guided_regex"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
    ("/detokenize", {"tokens": [VOCAB_SIZE]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    # a generating server: the pooling runner's routes say which server this is
    ("/v1/embeddings", {"input": "x"}, 400, "model"),
    ("/pooling", {"input": "x"}, 400, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_openai_error(
    h: Harness, path: str, body: Any, status: int, param: str | None
) -> None:
    before = len(h.fake.added)
    if isinstance(body, bytes):
        r = h.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = h.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert len(h.fake.added) == before, "a rejected request must not reach the engine"


def test_body_too_large_is_413_declared_or_chunked(h: Harness) -> None:
    big = b'{"prompt": "' + b"a" * (64 * 1024) + b'"}'
    r = h.http.post("/v1/completions", content=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 4096
        yield b'"}'

    r = h.http.post("/v1/completions", content=chunks())
    assert r.status_code == 413


def test_unknown_route_and_wrong_method(h: Harness) -> None:
    r = h.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = h.http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


# --- small routes ------------------------------------------------------------------------


def test_models_version_tokenize_detokenize(h: Harness) -> None:
    models = h.http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"], m["object"]) for m in models["data"]] == [
        (MODEL, MAX_MODEL_LEN, "model")
    ]
    assert h.http.get("/version").json() == {"version": __import__("kvflow").__version__}
    r = h.post("/tokenize", {"prompt": "Hi!"})
    assert r.json() == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": ids("Hi!")}
    r = h.post("/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert r.json()["tokens"] == chat_ids([{"role": "user", "content": "x"}])
    assert h.post("/detokenize", {"tokens": ids("héllo")}).json() == {"prompt": "héllo"}


def test_openapi_lists_routes_with_resolvable_schemas(h: Harness) -> None:
    doc = h.http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/pooling",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
    ]:
        assert path in doc["paths"]
    text = json.dumps(doc)
    schemas = doc["components"]["schemas"]
    for ref in set(part.split('"')[0] for part in text.split("#/components/schemas/")[1:]):
        assert ref in schemas
    assert "logprobs" in schemas["CompletionRequest"]["properties"]


# --- API key -----------------------------------------------------------------------------


def test_api_key(own: Callable[..., Harness]) -> None:
    h = own(api_key="secret")
    assert h.post("/v1/completions", {"prompt": "x"}).status_code == 401
    r = h.post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert h.http.get("/v1/models").status_code == 401
    ok = h.post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200
    assert h.http.get("/health").status_code == 200
    assert h.http.get("/metrics").status_code == 200
    client = openai.OpenAI(base_url=h.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    good = openai.OpenAI(base_url=h.url + "/v1", api_key="secret", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x").choices[0].text


def test_web_ui_page_is_open_and_its_stats_need_the_key(own: Callable[..., Harness]) -> None:
    h = own(api_key="secret")
    for path in ("/", "/ui"):
        page = h.http.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert (
            'src="/ui/app.js"' in page.text
            and "default-src 'self'" in page.headers["content-security-policy"]
        )
    assert h.http.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert h.http.get("/ui/app.css").headers["content-type"].startswith("text/css")
    assert h.http.get("/ui/stats").status_code == 401
    with h.http.stream("GET", "/ui/stats", headers={"Authorization": "Bearer secret"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    snapshot = json.loads(first[len("data: ") :])
    (engine,) = snapshot["engines"]
    assert (
        engine["engine"] == "0" and engine["num_running"] == h.client.latest_stats["0"].num_running
    )
    assert engine["block_map"] is None or len(engine["block_map"]["used"]) >= 1


# --- engine failures and disconnects -----------------------------------------------------


def _open_stream(h: Harness, body: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    events: list[Any] = []

    def read() -> None:
        with h.http.stream("POST", "/v1/completions", json=body) as response:
            events.extend(sse_events(response.iter_lines()))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, events


def test_engine_dead_fails_in_flight_and_health(own: Callable[..., Harness]) -> None:
    h = own()
    assert h.http.get("/health").status_code == 200
    thread, events = _open_stream(h, {"prompt": "hang on", "stream": True})
    h.fake.wait_for(lambda: bool(h.fake.added))
    responses: list[httpx.Response] = []
    full = threading.Thread(
        target=lambda: responses.append(h.post("/v1/completions", {"prompt": "hang 2"}))
    )
    full.start()
    h.fake.wait_for(lambda: len(h.fake.added) == 2)
    h.fake.kill("worker 0 exited with code -9")
    # Both end on the EngineDead message, before the client's 10 s read timeout: their
    # error names the worker, not a timeout or stale stats (the fake still publishes).
    thread.join(WAIT_S)
    full.join(WAIT_S)
    assert not thread.is_alive() and not full.is_alive()
    (response,) = responses
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "worker 0 exited" in error["message"] and error["code"] == 500
    assert response.status_code == 500 and "worker 0 exited" in response.json()["error"]["message"]
    health = h.http.get("/health")
    assert health.status_code == 503 and "worker 0 exited" in health.json()["error"]["message"]
    r = h.post("/v1/completions", {"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_stale_stats_turn_unhealthy_and_recover(own: Callable[..., Harness]) -> None:
    h = own(stats_timeout_s=1.0, resend_wait_s=0.0)  # no waiting for the engine
    thread, events = _open_stream(h, {"prompt": "hang on", "stream": True})
    h.fake.wait_for(lambda: bool(h.fake.added))
    h.fake.publish_stats = False
    h.fake.wait_for(lambda: h.http.get("/health").status_code == 503)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert "unresponsive" in events[-2]["error"]["message"]
    # Its KV blocks are freed: the abort goes out right after the error is streamed.
    h.fake.wait_for(lambda: h.fake.added[0].req_id in h.fake.aborted)
    h.fake.publish_stats = True
    h.fake.wait_for(lambda: h.http.get("/health").status_code == 200)


def test_stale_stats_hold_a_stream_and_resend_it_once_the_engine_speaks(
    own: Callable[..., Harness],
) -> None:
    h = own(stats_timeout_s=1.0)
    thread, events = _open_stream(h, {"prompt": "hang on", "stream": True})
    h.fake.wait_for(lambda: bool(h.fake.added))
    first = h.fake.added[0]
    h.fake.publish_stats = False
    h.fake.wait_for(lambda: h.http.get("/health").status_code == 503)
    h.fake.wait_for(lambda: first.req_id in h.fake.aborted)  # its KV blocks freed meanwhile
    assert thread.is_alive()  # held, not failed
    h.fake.publish_stats = True
    h.fake.wait_for(lambda: len(h.fake.added) == 2)
    assert h.fake.added[1].req_id == first.req_id and thread.is_alive()
    h.fake.kill("worker 0 exited with code -9")  # the engine's own verdict: no more waiting
    thread.join(WAIT_S)
    assert not thread.is_alive() and "worker 0 exited" in events[-2]["error"]["message"]


def test_the_port_opens_when_the_engine_serves(own: Callable[..., Harness]) -> None:
    h = own(stats_from_s=1.0)
    assert h.opened_after_s >= 1.0
    # The first request after the port opened is served, not refused as "not ready".
    r = h.post("/v1/completions", {"prompt": "x"})
    assert r.status_code == 200, r.text


def test_the_port_opens_without_stats_after_the_stats_timeout(
    own: Callable[..., Harness],
) -> None:
    h = own(stats_from_s=None, stats_timeout_s=1.0)
    assert h.opened_after_s >= 1.0
    health = h.http.get("/health")
    assert health.status_code == 503
    assert "no scheduler stats received yet" in health.json()["error"]["message"]
    h.fake.publish_stats = True
    h.fake.wait_for(lambda: h.http.get("/health").status_code == 200)


def test_watchdog_marks_engine_dead(own: Callable[..., Harness]) -> None:
    dead: list[str] = []
    h = own(watchdog=lambda: dead[0] if dead else None)
    assert h.http.get("/health").status_code == 200
    dead.append("scheduler process exited")
    h.fake.wait_for(lambda: h.http.get("/health").status_code == 503)
    assert h.post("/v1/completions", {"prompt": "x"}).status_code == 503


def test_client_disconnect_mid_stream_aborts(h: Harness) -> None:
    before = len(h.fake.added)
    with h.http.stream(
        "POST", "/v1/completions", json={"prompt": "hang up", "stream": True, "n": 2}
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    h.fake.wait_for(lambda: len(h.fake.added) == before + 2)
    children = sorted(a.req_id for a in h.fake.added[before:])
    h.fake.wait_for(lambda: set(children) <= set(h.fake.aborted))
    h.fake.wait_for(lambda: h.client.num_in_flight == 0)


def test_client_disconnect_non_streaming_aborts(h: Harness) -> None:
    before = len(h.fake.added)
    with pytest.raises(httpx.ReadTimeout):
        h.http.post("/v1/completions", json={"prompt": "hang up"}, timeout=0.5)
    (add,) = h.fake.added[before:]
    h.fake.wait_for(lambda: add.req_id in h.fake.aborted)


def test_shutdown_errors_streams_after_grace(own: Callable[..., Harness]) -> None:
    h = own(shutdown_grace_s=0.2)
    thread, events = _open_stream(h, {"prompt": "hang on", "stream": True})
    h.fake.wait_for(lambda: bool(h.fake.added))
    h.server.should_exit = True  # what SIGTERM does
    thread.join(5)
    h.thread.join(10)
    assert not h.thread.is_alive()
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
    assert h.fake.added[0].req_id in h.fake.aborted


# --- metrics -----------------------------------------------------------------------------

REQUIRED_METRICS = [
    "kvflow:num_requests_running",
    "kvflow:num_requests_waiting",
    "kvflow:kv_cache_usage_perc",
    "kvflow:prefix_cache_queries_total",
    "kvflow:prefix_cache_hits_total",
    "kvflow:num_preemptions_total",
    "kvflow:prompt_tokens_total",
    "kvflow:generation_tokens_total",
    "kvflow:request_success_total",
    "kvflow:time_to_first_token_seconds_bucket",
    "kvflow:inter_token_latency_seconds_bucket",
    "kvflow:request_time_per_output_token_seconds_bucket",
    "kvflow:e2e_request_latency_seconds_bucket",
    "kvflow:request_queue_time_seconds_bucket",
    "kvflow:request_prefill_time_seconds_bucket",
    "kvflow:request_decode_time_seconds_bucket",
    "kvflow:request_prompt_tokens_bucket",
    "kvflow:request_generation_tokens_bucket",
    "kvflow:iteration_tokens_total_bucket",
    "kvflow:http_requests_total",
    "kvflow:http_request_duration_seconds_bucket",
]


Sample = tuple[str, frozenset[tuple[str, str]]]


def _samples(text: str) -> dict[Sample, float]:
    """{(name, labels): value} of a Prometheus text exposition."""
    out: dict[Sample, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            pairs = [p.split("=", 1) for p in labels.rstrip("}").split(",") if p]
            out[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return out


def _at(samples: dict[Sample, float], name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, "engine": "0", **labels}.items()))]


def test_metrics_names_labels_and_values(h: Harness) -> None:
    assert h.post("/v1/completions", {"prompt": "abc", "max_tokens": 2}).status_code == 200
    latest = h.client.latest_stats["0"]  # read first: /metrics can only be newer
    r = h.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    names = {name for name, _ in samples}
    assert set(REQUIRED_METRICS) <= names
    assert _at(samples, "kvflow:request_success_total", finished_reason="length") >= 1
    assert _at(samples, "kvflow:kv_cache_usage_perc") == 0.25
    assert _at(samples, "kvflow:num_requests_waiting") == 2
    # Cumulative engine counters are exported as the same running totals.
    assert _at(samples, "kvflow:prompt_tokens_total") >= latest.num_prompt_tokens
    assert _at(samples, "kvflow:request_prompt_tokens_bucket", le="5.0") >= 1
    http = frozenset({"method": "POST", "route": "/v1/completions", "status": "200"}.items())
    assert samples[("kvflow:http_requests_total", http)] >= 1


def test_metrics_pass_promtool(h: Harness) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("KVFLOW_REQUIRE_PROMTOOL") == "1":  # set by .ci/run
            pytest.fail("promtool is required but not installed (Debian package 'prometheus')")
        pytest.skip("promtool not installed (Debian package 'prometheus'); .ci/run installs it")
    h.post("/v1/completions", {"prompt": "abc"})
    text = h.http.get("/metrics").text
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    # The only findings allowed are the ones vLLM's names imply: the `kvflow:` colon
    # namespace (promtool reserves ':' for recording rules) and the vLLM name
    # iteration_tokens_total on a histogram. Anything else (a parse error, a missing
    # HELP, a counter without _total, ...) fails.
    allowed = (
        "metric names should not contain ':'",
        'non-counter metrics should not have "_total" suffix',
    )
    problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    unexpected = [p for p in problems if not p.endswith(allowed)]
    assert not unexpected, unexpected
    assert all(
        p.startswith("kvflow:iteration_tokens_total") for p in problems if p.endswith(allowed[1])
    )
    assert result.returncode in (0, 3), result  # 3 = lint findings only


def test_cumulative_counters_never_go_backwards() -> None:
    metrics = FrontendMetrics(MODEL, MAX_MODEL_LEN)

    def stats(prompt_tokens: int, engine: str = "0") -> SchedulerStats:
        return SchedulerStats(time.time(), engine, 0, 0, 0.0, num_prompt_tokens=prompt_tokens)

    for value in (10, 15, 15, 3, 5):  # 3: the engine restarted and counts from 0 again
        metrics.observe_scheduler_stats(stats(value))
    metrics.observe_scheduler_stats(stats(4, engine="1"))
    samples = _samples(metrics.render().decode())
    assert _at(samples, "kvflow:prompt_tokens_total") == 20
    assert _at(samples, "kvflow:prompt_tokens_total", engine="1") == 4


def test_request_tracker_timings() -> None:
    metrics = FrontendMetrics(MODEL, MAX_MODEL_LEN)
    tracker = metrics.track_request(arrival_time=100.0)
    common = {
        "num_prompt_tokens": 7,
        "queued_time": 100.5,
        "scheduled_time": 101.0,
        "first_token_time": 102.0,
    }
    tracker.observe(RequestOutputDelta("r", "a", [1], num_output_tokens=1, **common), now=102.5)
    tracker.observe(RequestOutputDelta("r", "bc", [2, 3], num_output_tokens=3, **common), now=103.5)
    tracker.observe(
        RequestOutputDelta("r", "", [], finish_reason="stop", num_output_tokens=3, **common),
        now=104.0,
    )
    tracker.abandon(now=200.0)  # already finished: no second observation
    s = _samples(metrics.render().decode())
    assert _at(s, "kvflow:time_to_first_token_seconds_sum") == 2.5
    assert _at(s, "kvflow:inter_token_latency_seconds_count") == 2
    assert _at(s, "kvflow:inter_token_latency_seconds_sum") == 1.0
    assert _at(s, "kvflow:e2e_request_latency_seconds_sum") == 4.0
    assert _at(s, "kvflow:request_queue_time_seconds_sum") == 0.5
    assert _at(s, "kvflow:request_prefill_time_seconds_sum") == 1.0
    assert _at(s, "kvflow:request_decode_time_seconds_sum") == 1.0
    assert _at(s, "kvflow:request_time_per_output_token_seconds_sum") == 0.5
    assert _at(s, "kvflow:request_generation_tokens_sum") == 3
    assert _at(s, "kvflow:request_success_total", finished_reason="stop") == 1


# --- the process entry point -------------------------------------------------------------

RUN_FRONTEND = """
import sys
from pathlib import Path
from kvflow.proto.addresses import ServiceAddresses
from kvflow.services.frontend.config import FrontendConfig
from kvflow.services.frontend.main import run_frontend

config = FrontendConfig(
    served_model_name="tiny-test", max_model_len=64, vocab_size=300, port=int(sys.argv[1]),
    shutdown_grace_s=0.3,
)
run_frontend(config, ServiceAddresses.ipc(sys.argv[2]), Path(sys.argv[3]),
             on_ready=lambda: print("READY", flush=True))
print("EXITED", flush=True)
"""


@pytest.mark.slow
def test_run_frontend_shuts_down_cleanly_on_sigterm(tmp_path: Path) -> None:
    TOKENIZER.save_pretrained(tmp_path / "model")
    (tmp_path / "ipc").mkdir()
    fake = FakeEngine(ServiceAddresses.ipc(str(tmp_path / "ipc")))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(port), str(tmp_path / "ipc"), str(tmp_path / "model")]
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_FRONTEND, *argv], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        health = f"http://127.0.0.1:{port}/health"
        fake.wait_for(lambda: httpx.get(health).status_code == 200, timeout=10)
        events: list[Any] = []
        url = f"http://127.0.0.1:{port}/v1/completions"

        def read() -> None:
            with httpx.stream("POST", url, json={"prompt": "hang on", "stream": True}) as r:
                events.extend(sse_events(r.iter_lines()))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        fake.wait_for(lambda: bool(fake.added), timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert proc.stdout.read().strip() == "EXITED"  # returned normally: no re-raised signal
        reader.join(5)
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        fake.wait_for(lambda: fake.added[0].req_id in fake.aborted)
    finally:
        proc.kill()
        fake.close()


def test_not_ready_before_the_first_stats(tmp_path: Path) -> None:
    client = EngineClient(ServiceAddresses.ipc(str(tmp_path)), "frontend-x", stats_timeout_s=5)
    problem = client.health_problem()
    assert problem is not None and "no scheduler stats received yet" in problem
    client.check_liveness()  # nothing seen yet: not dead, just not ready
    assert client.health_problem() == problem


def _stats(incarnation: str) -> SchedulerStats:
    return SchedulerStats(
        timestamp=time.time(),
        engine="0",
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        incarnation=incarnation,
    )


def test_a_restarted_scheduler_fails_the_requests_in_flight(tmp_path: Path) -> None:
    """With no waiting allowed (tests/unit/test_engine_client_link.py holds them)."""
    import asyncio

    client = EngineClient(ServiceAddresses.ipc(str(tmp_path)), "frontend-x", resend_wait_s=0.0)
    client._handle(_stats("first"))
    in_flight: asyncio.Queue[RequestOutputDelta] = asyncio.Queue()
    client._queues["req-1#0"] = in_flight
    client._owners["req-1#0"] = 0
    client._handle(_stats("first"))  # the same scheduler: nothing happens
    assert in_flight.empty() and client.num_in_flight == 1
    client._handle(_stats("second"))
    delta = in_flight.get_nowait()
    assert delta.finish_reason == "error" and "restarted" in (delta.error or "")
    assert client.num_in_flight == 0 and client.is_healthy


def test_engine_dead_is_cleared_by_a_new_scheduler_but_a_watchdog_verdict_is_not(
    tmp_path: Path,
) -> None:
    addresses = ServiceAddresses.ipc(str(tmp_path))
    client = EngineClient(addresses, "frontend-x")
    client._handle(_stats("first"))
    client._handle(EngineDead("worker rank 0 failed"))
    assert client.health_problem() == "worker rank 0 failed"
    client._handle(_stats("first"))  # a late stats message of the dead one
    assert client.health_problem() == "worker rank 0 failed"
    client._handle(_stats("second"))
    assert client.is_healthy

    watched = EngineClient(addresses, "frontend-y", watchdog=lambda: "scheduler exited")
    watched._handle(_stats("first"))
    watched.check_liveness()
    watched._handle(_stats("second"))
    assert watched.health_problem() == "scheduler exited"
