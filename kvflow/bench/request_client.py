"""One streaming /v1/completions (or /v1/chat/completions) request, timed chunk by chunk
(vLLM's openai clients; a chat chunk without content, such as the role, is not one).

    sent = perf_counter() before the POST
    for each SSE event with a non-empty `choices` list (a content chunk, text may be ""):
        first one: ttft = now - sent;  later ones: itl.append(now - previous chunk)
    the event with `usage` only (stream_options.include_usage): output_tokens
    latency = last content chunk - sent   (the usage event and [DONE] do not count)

A request fails (success False, `error` says why) on a non-200 reply, an in-band error
event, a transport error, or a stream without a single content chunk. Failures are
recorded, never raised: one bad request must not stop a benchmark.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvflow.bench.datasets import SampleRequest

# vLLM's client timeout: long runs at high load must not be cut off by the client.
REQUEST_TIMEOUT_S = 6 * 60 * 60


@dataclass
class RequestOutput:
    """What the client saw of one request; times in seconds (perf_counter clock)."""

    prompt_len: int
    success: bool = False
    generated_text: str = ""
    output_tokens: int = 0  # from the usage event; 0 when the server sent none
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # one gap per content chunk after the 1st
    latency: float = 0.0
    queued_time: float = 0.0  # when its arrival was due (it may then wait for a slot)
    start_time: float = 0.0  # when it was sent
    error: str = ""


def make_client(max_connections: int | None) -> httpx.AsyncClient:
    """One connection pool for the run; unbounded unless --max-concurrency bounds it."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None)
    headers = {}
    api_key = os.environ.get("OPENAI_API_KEY")  # what OpenAI clients and vLLM's bench read
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S), headers=headers
    )


def completion_payload(model: str, request: SampleRequest, ignore_eos: bool) -> dict[str, Any]:
    """Greedy, streamed, with usage; `max_tokens` is the request's expected output."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": request.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def send_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int
) -> RequestOutput:
    output = RequestOutput(prompt_len=prompt_len)
    output.start_time = output.queued_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                output.error = f"HTTP {response.status_code}: {body[:500]}"
                return output
            await _read_stream(response, output)
    except Exception as exc:  # transport error, malformed event: this request's failure
        output.success = False
        output.error = f"{type(exc).__name__}: {exc}"
    return output


async def _read_stream(response: httpx.Response, output: RequestOutput) -> None:
    """Fill `output` from the SSE events of a 200 reply."""
    last = output.start_time
    texts: list[str] = []
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, other SSE fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        now = time.perf_counter()
        if "error" in event:
            output.error = str(event["error"].get("message", event["error"]))
            return
        if event.get("choices"):
            text = _chunk_text(event["choices"][0])
            if text is None:
                continue  # a chat stream's role-only chunk: no token yet
            if texts:
                output.itl.append(now - last)
            else:
                output.ttft = now - output.start_time
            last = now
            texts.append(text)
        elif event.get("usage"):
            output.output_tokens = int(event["usage"].get("completion_tokens") or 0)
    output.generated_text = "".join(texts)
    output.latency = last - output.start_time
    output.success = bool(texts)
    if not texts:
        output.error = "the stream ended without a single content chunk"


def _chunk_text(choice: dict[str, Any]) -> str | None:
    """A completions chunk's text ("" counts), or a chat chunk's content (None: none)."""
    if "delta" in choice:
        return choice["delta"].get("content") or None
    return str(choice.get("text") or "")
