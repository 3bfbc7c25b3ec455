"""Beam search through a real `kvflow serve`: `use_beam_search` on /v1/completions and
/v1/chat/completions gives the offline engine's beams (n results of best_of beams),
streaming sends each beam whole when the search ends, and vLLM's rules answer 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import ENGINE_ARGS, MODEL_NAME, Server, sse_events

from kvflow import LLM, SamplingParams
from kvflow.sampling_params import BeamSearch

pytestmark = pytest.mark.slow  # a server of its own (~40 s to start on 2 cores)

PROMPT = "Once upon a time"
BODY = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
        "use_beam_search": True, "n": 2, "best_of": 3, "length_penalty": 0.5}  # fmt: skip


def _option(name: str) -> str:
    return ENGINE_ARGS[ENGINE_ARGS.index(name) + 1]


@pytest.fixture(scope="module")
def offline_texts(tiny_model_dir: Path) -> list[str]:
    llm = LLM(str(tiny_model_dir), dtype=_option("--dtype"), device=_option("--device"),
              num_blocks=int(_option("--num-blocks")))  # fmt: skip
    params = SamplingParams(
        n=2, temperature=0.0, max_tokens=8, ignore_eos=True,
        beam_search=BeamSearch(beam_width=3, length_penalty=0.5),
    )  # fmt: skip
    return [c.text for c in llm.generate([PROMPT], params)[0].outputs]


def post(server: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=120.0)


def test_completions_and_chat_beam_search(server: Server, offline_texts: list[str]) -> None:
    response = post(server, "/v1/completions", BODY)
    assert response.status_code == 200, response.text
    result = response.json()
    assert [c["text"] for c in result["choices"]] == offline_texts
    assert len(set(offline_texts)) == 2
    assert result["usage"]["completion_tokens"] == 16
    chat = {k: v for k, v in BODY.items() if k not in ("prompt", "best_of")}
    chat["messages"] = [{"role": "user", "content": PROMPT}]
    response = post(server, "/v1/chat/completions", chat)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


def test_streamed_beams_arrive_whole(server: Server, offline_texts: list[str]) -> None:
    texts = ["", ""]
    finishes = [None, None]
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={**BODY, "stream": True}, timeout=120.0) as response:  # fmt: skip
        assert response.status_code == 200
        for event in sse_events(response):
            if event == "[DONE]":
                break
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
                finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert texts == offline_texts and finishes == ["length", "length"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 0.8}, "temperature"),
        ({"n": 4, "best_of": 2}, "best_of"),
        ({"use_beam_search": False}, "length_penalty"),
    ],
)
def test_bad_beam_search_requests(server: Server, fields: dict[str, Any], param: str) -> None:
    response = post(server, "/v1/completions", {**BODY, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
