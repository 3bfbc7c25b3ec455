"""A P/D stream whose decode connection dies in the middle goes on as one stream: behind
the proxy (in process, its network wrapped so that the first decode stream breaks after
some events, in the middle of one), a producer and a consumer `kvflow serve` with the
shared-storage or the zmq connector. The proxy resumes the stream on the decode instance from the
tokens the client has (a signed kv_resume), and the client sees one stream, no error
event, and for greedy decoding the text and usage of an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import (
    KVFLOW,
    MODEL_NAME,
    Server,
    child_pid,
    free_port,
    metric_values,
    sse_events,
    start_server,
    stop_server,
    wait_for,
)

from kvflow.cluster_secret import SECRET_FILE_ENV, ClusterSecret
from kvflow.services.proxy.app import build_app
from kvflow.services.proxy.pairing import InstancePools
from kvflow.services.proxy.resend import ResendPolicy

pytestmark = pytest.mark.slow

ENGINE = ["--num-threads", "1", "--block-size", "8"]
PROMPT = "Once upon a time in a land far away there lived a careful engineer who"
MAX_TOKENS = 40


class _CutStream(httpx.AsyncByteStream):
    """A decode stream that breaks halfway into its event number `after` + 1."""

    def __init__(self, inner: httpx.AsyncByteStream, after: int) -> None:
        self.inner, self.after = inner, after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        buffer, sent = b"", 0
        async for chunk in self.inner:
            buffer += chunk
            ends = [i + 2 for i in range(len(buffer)) if buffer.startswith(b"\n\n", i)]
            if len(ends) > self.after:  # the next event's first bytes, then the break
                yield buffer[sent : ends[self.after - 1] + 10]
                break
            yield buffer[sent:]
            sent = len(buffer)
        await self.inner.aclose()  # type: ignore[attr-defined]
        raise httpx.ReadError("connection reset by peer")


class _CutFirstDecode(httpx.AsyncBaseTransport):
    """The network, except that the first streamed decode request breaks mid-stream."""

    def __init__(self, decode_url: str, after: int | None) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.decode_url, self.after = decode_url, after
        self.decode_bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not str(request.url).startswith(self.decode_url):
            return response
        self.decode_bodies.append(json.loads(request.content))
        if self.after is None or len(self.decode_bodies) > 1:
            return response
        stream = _CutStream(response.stream, self.after)  # type: ignore[arg-type]
        return httpx.Response(response.status_code, headers=response.headers, stream=stream)


@pytest.fixture(scope="module", params=["shared-storage", "zmq"])
def pair(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server, str]]:
    """(prefill, decode, the prefill's KV address: "" with shared storage)."""
    logs = tmp_path_factory.mktemp("resume")
    if request.param == "zmq":
        kv_port = free_port()
        extras = [{"kv_port": kv_port}, {}]
        address = f"tcp://127.0.0.1:{kv_port}"
    else:
        extras, address = [{"storage_path": str(logs / "kv")}] * 2, ""
    servers: list[Server] = []
    try:
        for role, extra in zip(("kv_producer", "kv_consumer"), extras):
            config = {"kv_role": role, "kv_connector": request.param,
                      "kv_connector_extra_config": extra}  # fmt: skip
            servers.append(start_server(tiny_model_dir, logs, *ENGINE, "--kv-transfer-config",
                                        json.dumps(config)))  # fmt: skip
        yield servers[0], servers[1], address
    finally:
        for server in servers:
            stop_server(server)


def _stream(
    pair: tuple[Server, Server, str], path: str, body: dict[str, Any], after: int | None
) -> tuple[list[Any], list[dict[str, Any]], str]:
    """The client's events through the proxy, the decode requests, and /metrics."""
    prefill, decode, address = pair
    transport = _CutFirstDecode(decode.base_url, after)
    secret = ClusterSecret.read(os.environ[SECRET_FILE_ENV])
    policy = ResendPolicy(backoff_s=0.01, prefill_fallback=False)
    pools = InstancePools([prefill.base_url], [decode.base_url], [address] if address else [])
    app = build_app(pools, 120.0, secret, policy, transport)

    async def go() -> tuple[str, str]:
        asgi = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=asgi, base_url="http://proxy", timeout=120) as c:
            response = await c.post(path, json={"model": MODEL_NAME, **body, "stream": True})
            assert response.status_code == 200, response.text
            return response.text, (await c.get("/metrics")).text

    text, metrics = asyncio.run(go())
    events = []
    for event in text.split("\n\n"):
        if event:
            data = event.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events, transport.decode_bodies, metrics


def _texts(events: list[Any]) -> dict[int, str]:
    """Each choice's streamed text."""
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            piece = choice.get("text") or choice.get("delta", {}).get("content") or ""
            texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


CHAT = {"messages": [{"role": "user", "content": PROMPT}]}
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "seed": 7}  # a seeded sampler goes on where it stopped


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": PROMPT, **GREEDY}),
        ("/v1/chat/completions", {**CHAT, **GREEDY}),
        ("/v1/completions", {"prompt": PROMPT, "n": 2, **SEEDED}),
        ("/v1/chat/completions", {**CHAT, "n": 2, **SEEDED}),
    ],
    ids=["completions", "chat", "completions-n2-seeded", "chat-n2-seeded"],
)
def test_a_stream_broken_mid_way_is_resumed_as_one_stream(
    pair: tuple[Server, Server, str], path: str, body: dict[str, Any]
) -> None:
    body = {**body, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    n = body.get("n", 1)
    whole, _, _ = _stream(pair, path, body, after=None)
    events, sent, metrics = _stream(pair, path, body, after=8)

    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    assert _texts(events) == _texts(whole) and len(_texts(whole)) == n
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached: the cache's)
    assert [events[-2]["usage"][k] for k in counts] == [whole[-2]["usage"][k] for k in counts]
    assert events[-2]["usage"]["completion_tokens"] == n * MAX_TOKENS
    assert len({(e["id"], e["created"]) for e in events[:-1]}) == 1
    assert not any("token_ids" in c for e in events[:-1] for c in e["choices"])
    roles = [c for e in events[:-1] for c in e["choices"] if c.get("delta", {}).get("role")]
    assert len(roles) == (n if "chat" in path else 0)
    resumed = sent[1]["kv_resume"]["choices"]
    assert 0 < sum(len(c["token_ids"]) for c in resumed) < n * MAX_TOKENS
    assert "kvflow:proxy_stream_resumes_total 1" in metrics
    assert "kvflow:proxy_broken_streams_total 0" in metrics


def test_decode_instances_killed_mid_stream_cost_the_client_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real thing: `kvflow proxy` before one prefill and three decode instances. The
    one holding a stream loses its worker for good (`--max-worker-restarts 0`: its
    frontend ends the stream with an error event); in a second stream the one holding it
    has its whole process group SIGKILLed (the connection drops). Each stream goes on
    from another decode instance, with the text of an uninterrupted run."""
    storage = {"storage_path": str(tmp_path / "kv")}

    def kv(role: str) -> list[str]:
        config = {"kv_role": role, "kv_connector": "shared-storage",
                  "kv_connector_extra_config": storage}  # fmt: skip
        return ["--kv-transfer-config", json.dumps(config)]

    servers = [start_server(tiny_model_dir, tmp_path, *ENGINE, *kv("kv_producer"))]
    proxy = None
    try:
        servers += [start_server(tiny_model_dir, tmp_path, *ENGINE, *kv("kv_consumer"),
                                 "--max-worker-restarts", "0") for _ in range(3)]  # fmt: skip
        url = f"http://127.0.0.1:{free_port()}"
        command = [str(KVFLOW), "proxy", "--port", url.rsplit(":", 1)[1]]
        command += ["--prefill", servers[0].base_url, "--resend-max", "1"]
        for decode in servers[1:]:
            command += ["--decode", decode.base_url]
        with open(tmp_path / "proxy.log", "wb") as log:  # (the secret: the tests' env)
            proxy = subprocess.Popen(command, stdout=log, stderr=log)
        assert wait_for(lambda: _up(url), 60.0), (tmp_path / "proxy.log").read_text()
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        whole = httpx.post(url + "/v1/completions", json=body, timeout=120.0)
        assert whole.status_code == 200, whole.text
        live = servers[1:]
        for resumes, kill in enumerate((_kill_worker, _kill_instance), start=1):
            # Stats older than the stream would name the wrong instance: wait them out.
            assert wait_for(lambda: not any(_runs(d) for d in live), 10.0)
            events, killed = _read_killing(url, {**body, "stream": True}, live, kill)
            live.remove(killed)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
            assert _texts(events) == {0: whole.json()["choices"][0]["text"]}
            metrics = httpx.get(url + "/metrics").text
            assert f"kvflow:proxy_stream_resumes_total {resumes}" in metrics, metrics
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=10)
        for server in servers:
            if server.process.poll() is None:
                stop_server(server)


LONG = 480  # tokens: the kill lands while the decode instance still generates


def _kill_worker(decode: Server) -> None:
    worker = child_pid(decode.pid, "kvflow-worker0")
    assert worker is not None
    os.kill(worker, signal.SIGKILL)  # the restart budget is 0: the engine is dead for good


def _kill_instance(decode: Server) -> None:
    os.killpg(decode.pid, signal.SIGKILL)  # HTTP, engine and worker at once


def _read_killing(
    url: str, body: dict[str, Any], decodes: list[Server], kill: Callable[[Server], None]
) -> tuple[list[Any], Server]:
    """The stream's events; after the tenth, the decode instance running it is killed
    (and returned)."""
    events: list[Any] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120.0) as response:
        assert response.status_code == 200
        for event in sse_events(response):
            events.append(event)
            if len(events) == 10:
                victim = _running(decodes)
                kill(victim)
    return events, victim


def _running(decodes: list[Server]) -> Server:
    """The decode instance that runs a request (its stats say so within 0.5 s)."""
    running: list[Server] = []

    def found() -> bool:
        running[:] = [d for d in decodes if _runs(d)]
        return len(running) == 1

    assert wait_for(found, 10.0), "no decode instance runs the stream"
    return running[0]


def _runs(decode: Server) -> bool:
    try:
        return bool(metric_values(decode.base_url).get("kvflow:num_requests_running"))
    except httpx.HTTPError:  # its HTTP process is going (its engine was killed)
        return False


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
