"""`kvflow bench serve` client side: SSE timing with a fake clock, the arrival loop
with --max-concurrency against an in-memory server, the report, and the plot data."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvflow.bench import plot, request_client, serve
from kvflow.bench.datasets import SampleRequest
from kvflow.bench.request_client import RequestOutput, completion_payload
from kvflow.bench.serve_metrics import calculate_metrics
from kvflow.bench.serve_report import RunSetup, format_summary, result_json, result_path

URL = "http://bench.test/v1/completions"


def _sse(*events: Any) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}


class FakeClock:
    def __init__(self, times: list[float]) -> None:
        self.times: Iterator[float] = iter(times)

    def perf_counter(self) -> float:
        return next(self.times)


def _send(monkeypatch: pytest.MonkeyPatch, body: bytes, times: list[float], status: int = 200):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(request_client, "time", FakeClock(times))
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go() -> RequestOutput:
        async with httpx.AsyncClient(transport=transport) as client:
            return await request_client.send_request(client, URL, {"prompt": [1]}, prompt_len=3)

    return asyncio.run(go())


def test_stream_timing_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty-text chunk still counts (vLLM: a special token may decode to "").
    body = _sse(_chunk("Hel"), _chunk(""), _chunk("lo"), _chunk("!", "length"), USAGE, b"[DONE]")
    out = _send(monkeypatch, body, [10.0, 10.5, 10.6, 10.8, 11.1, 11.2])
    assert out.success and out.error == ""
    assert out.start_time == 10.0
    assert out.ttft == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.1, 0.2, 0.3])
    assert out.latency == pytest.approx(1.1)  # the usage event does not extend it
    assert (out.generated_text, out.output_tokens, out.prompt_len) == ("Hello!", 4, 3)


def test_stream_without_usage_leaves_tokens_to_count(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _send(monkeypatch, _sse(_chunk("a"), b"[DONE]"), [0.0, 0.25])
    assert out.success and out.output_tokens == 0 and out.itl == []
    assert out.ttft == out.latency == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (b'{"error": {"message": "no such model"}}', 404, 'HTTP 404: {"error"'),
        (_sse(_chunk("a"), {"error": {"message": "engine died"}}), 200, "engine died"),
        (_sse(USAGE, b"[DONE]"), 200, "without a single content chunk"),
    ],
)
def test_failures_are_recorded(
    monkeypatch: pytest.MonkeyPatch, body: bytes, status: int, error: str
) -> None:
    out = _send(monkeypatch, body, [0.0, 0.1, 0.2, 0.3], status)
    assert not out.success
    assert error in out.error


def test_payload_is_greedy_streamed_with_usage() -> None:
    request = SampleRequest([5, 6, 7], 3, 9)
    assert completion_payload("m", request, ignore_eos=True) == {
        "model": "m",
        "prompt": [5, 6, 7],
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    assert "ignore_eos" not in completion_payload("m", request, ignore_eos=False)


class SlowServer:
    """Streams max_tokens chunks 5 ms apart and records how many requests overlap."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        return httpx.Response(200, content=self._stream(payload["max_tokens"]))

    async def _stream(self, tokens: int) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        for _ in range(tokens):
            await asyncio.sleep(0.005)
            yield _sse(_chunk("t"))
        # Before the last yield: the client stops reading at [DONE], so code after it
        # would only run when the generator is collected.
        self.in_flight -= 1
        yield _sse({"choices": [], "usage": {"completion_tokens": tokens}}, b"[DONE]")


def _bench_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    return parser.parse_args(["--disable-tqdm", *flags])


def _run_benchmark(server: SlowServer, args: argparse.Namespace, n: int) -> serve.BenchmarkRun:
    requests = [SampleRequest([1, 2], 2, 3) for _ in range(n)]
    payloads = [completion_payload("m", r, True) for r in requests]

    async def go() -> serve.BenchmarkRun:
        transport = httpx.MockTransport(server.handle)
        async with httpx.AsyncClient(transport=transport) as client:
            return await serve.benchmark(
                client, URL, payloads, requests, args.request_rate[0], args
            )

    return asyncio.run(go())


def test_max_concurrency_caps_requests_in_flight() -> None:
    server = SlowServer()
    run = _run_benchmark(server, _bench_args("--max-concurrency", "2"), 6)
    assert server.peak == 2
    assert all(o.success and o.output_tokens == 3 and len(o.itl) == 2 for o in run.outputs)
    # all were due at once (rate inf); the later ones waited for a slot
    assert all(o.queued_time == run.start_time for o in run.outputs)
    waits = sorted(o.start_time - o.queued_time for o in run.outputs)
    assert waits[2] - waits[1] > 0.01  # the 3rd started when the 1st's 3 chunks were done
    assert run.duration_s >= max(o.start_time + o.latency for o in run.outputs) - run.start_time


def test_request_rate_spaces_the_sends() -> None:
    server = SlowServer()
    run = _run_benchmark(server, _bench_args("--request-rate", "50", "--burstiness", "100"), 4)
    outputs = sorted(run.outputs, key=lambda o: o.queued_time)
    due = [o.queued_time - run.start_time for o in outputs]
    # burstiness 100: nearly regular gaps of 1/50 s, scaled to span exactly 3/50 s
    assert due[0] == 0 and due[-1] == pytest.approx(3 / 50)
    assert all(0.01 < b - a < 0.03 for a, b in itertools.pairwise(due))
    # Each was sent in turn and not before it was due (how late is up to the machine's
    # load; 1 ms: the event loop may run a timer a clock tick early).
    sent = [o.start_time for o in outputs]
    assert sent == sorted(sent)
    assert all(o.start_time >= o.queued_time - 1e-3 for o in outputs)


# ---- report -------------------------------------------------------------------------


def _outputs() -> list[RequestOutput]:
    a = RequestOutput(3, True, "ab", 2, 0.1, [0.2], 0.3, queued_time=5.0, start_time=5.0)
    b = RequestOutput(4, True, "c", 1, 0.4, [], 0.4, queued_time=5.0, start_time=5.5)
    return [a, b, RequestOutput(5, error="boom", queued_time=5.2, start_time=5.2)]


SETUP = RunSetup("org/tiny", "/models/tiny", 3, 2.0, 1.0, 4, date="20250101-120000")


def test_summary_in_vllm_layout() -> None:
    metrics = calculate_metrics(_outputs(), 1.0, [50.0, 99.9], {"ttft": 200.0}, len)
    text = format_summary(metrics, SETUP, 1.0, ["ttft", "e2el"], with_goodput=True).splitlines()
    assert text[0] == "============ Serving Benchmark Result ============"
    assert text[1] == f"{'Successful requests:':<40} {2:<10}"
    assert text[2] == f"{'Failed requests:':<40} {1:<10}"
    assert f"{'Maximum request concurrency:':<40} {4:<10}" in text
    assert f"{'Request rate configured (RPS):':<40} {2.0:<10.2f}" in text
    assert f"{'Request goodput (req/s):':<40} {1.0:<10.2f}" in text
    assert "---------------Time to First Token----------------" in text
    assert f"{'P99.9 TTFT (ms):':<40} {399.7:<10.2f}" in text
    assert "----------------End-to-end Latency----------------" in text
    assert not any("TPOT" in line for line in text)
    assert text[-1] == "=" * 50


def test_result_json_keys_and_file_name() -> None:
    metrics = calculate_metrics(_outputs(), 1.0, [99.0], {}, len)
    doc = result_json(metrics, SETUP, _outputs(), 1.0, ["ttft", "tpot", "itl", "e2el"], False)
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                "burstiness", "max_concurrency", "duration", "completed", "total_input_tokens",
                "total_output_tokens", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "generated_texts", "errors"):  # fmt: skip
        assert key in doc, key
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{name}_ms" in doc
    assert doc["request_goodput"] is None and doc["errors"] == ["", "", "boom"]
    assert doc["input_lens"] == [3, 4, 5] and doc["output_lens"] == [2, 1, 0]
    json.dumps(doc)  # serialisable as it is
    assert result_path(SETUP, None, None, sweep=False) == Path(
        "openai-2.0qps-concurrency4-tiny-20250101-120000.json"
    )
    assert result_path(SETUP, "out", "r.json", sweep=True) == Path("out/r-2.0qps.json")
    inf = RunSetup("m", "m", 1, math.inf, 1.0, None, date="d")
    assert result_json(metrics, inf, [], 1.0, [], False)["request_rate"] == "inf"


# ---- plot data ----------------------------------------------------------------------


def test_timeline_rows_in_arrival_order() -> None:
    rows = plot.timeline_rows(_outputs(), start_time=5.0)
    assert [(r.queued, r.sent, r.first_token, r.end, r.success) for r in rows] == [
        (0.0, 0.0, pytest.approx(0.1), pytest.approx(0.3), True),
        (0.0, 0.5, pytest.approx(0.9), pytest.approx(0.9), True),
        (pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.2), pytest.approx(0.2), False),
    ]


def test_curve_point_uses_median_and_p99() -> None:
    point = plot.curve_point(2.0, _outputs(), 2.0, len)
    assert (point.rate, point.request_throughput, point.output_throughput) == (2.0, 1.0, 1.5)
    assert point.median_ms["ttft"] == pytest.approx(250.0)
    assert point.p99_ms["ttft"] == pytest.approx(100 + 0.99 * 300)


def test_draw_writes_png_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot.draw_timeline(plot.timeline_rows(_outputs(), 5.0), tmp_path / "timeline.png")
    points = [plot.curve_point(r, _outputs(), 1.0 / r, len) for r in (1.0, 2.0, 4.0)]
    plot.draw_curves(points, tmp_path / "curves.png")
    for name in ("timeline.png", "curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
