"""A request resent with the tokens it already generated (`AddRequest.output_token_ids`,
what the frontend does when a data-parallel engine dies) continues exactly as if it
had never moved: the same seeded samples under a repetition penalty, and text that
picks up where the streamed text stopped."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.offline.engine import OFFLINE_FRONTEND
from kvflow.proto.engine import AddRequest
from kvflow.sampling_params import StructuredOutputsParams

PROMPT = [101, 2050, 377, 4096, 58, 912]
SPLIT = 5


def run_resumed(llm: LLM, params: SamplingParams, done: list[int]) -> Any:
    engine = llm.engine
    message = AddRequest(
        "moved", PROMPT, params, time.time(), frontend_id=OFFLINE_FRONTEND, output_token_ids=done
    )
    engine.outputs.add("moved", None, PROMPT, ["moved"])
    engine.core.add_request(message, now=time.time())
    engine.streams.add(message)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    (output,) = finished
    return output.outputs[0]


@pytest.mark.parametrize("guided", [False, True])
def test_a_resumed_request_continues_as_if_it_never_moved(
    tiny_model_dir: Any, guided: bool
) -> None:
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", num_blocks=64)
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=7, repetition_penalty=1.3, ignore_eos=True
    )
    if guided:
        params = SamplingParams(
            max_tokens=24,
            temperature=1.0,
            seed=7,
            structured_outputs=StructuredOutputsParams(regex="[a-z]{4,40}"),
        )
    whole = llm.generate([PROMPT], params)[0].outputs[0]
    assert len(whole.token_ids) > SPLIT + 2
    moved = run_resumed(llm, params, whole.token_ids[:SPLIT])
    assert moved.token_ids == whole.token_ids[SPLIT:]
    assert moved.finish_reason == whole.finish_reason
    streamed = llm.engine.tokenizer.decode(whole.token_ids[:SPLIT])
    assert moved.text and streamed + moved.text == whole.text
    llm.engine.kv_cache.check_integrity()
