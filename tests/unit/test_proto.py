"""Every wire message survives a MessagePack round trip unchanged (no pickle anywhere)."""

from __future__ import annotations

import msgspec
import pytest

from kvflow.proto.engine import AbortRequests, AddRequest, EngineOutputs, TokenDelta
from kvflow.proto.multimodal import ImageInput, MRopePositions, PixelTensor
from kvflow.proto.stats import KVBlockMap, PhaseTotals, SchedulerStats, StepRecord
from kvflow.proto.step import (
    CachedRequestData,
    NewRequestData,
    SchedulerHello,
    Shutdown,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerInput,
)
from kvflow.sampling_params import SamplingParams

PARAMS = SamplingParams(
    n=2, max_tokens=7, temperature=0.5, top_k=4, logit_bias={3: -1.5}, stop=["\n"], seed=3
)
LOGPROBS = TokenLogprobs(token_ids=[5, 1, 9], logprobs=[-0.1, -2.0, -3.5], rank=1)
# A Qwen2.5-VL image: 4 patch rows of 2 values on a 1 x 2 x 2 grid, one placeholder at
# index 1 of a 3-token prompt, and the prompt's M-RoPE positions (int32 [3, 3]).
QWEN_IMAGE = ImageInput("ab12", 1, 1, PixelTensor("float32", [4, 2], bytes(32)), [1, 2, 2])
MROPE = MRopePositions(-1, bytes(36))

MESSAGES = [
    AddRequest("r1", [1, 2, 3], PARAMS, arrival_time=12.5, priority=2, cache_salt="t"),
    AddRequest("r2", [1, 2, 3], PARAMS, arrival_time=1.0, images=[QWEN_IMAGE], mrope=MROPE),
    AbortRequests(["r1", "r2"], finish_reason="stop", stop_reason="###"),
    EngineOutputs(
        deltas=[
            TokenDelta(
                "r1", [4], finish_reason="length", logprobs=[LOGPROBS], num_cached_tokens=16
            ),
            TokenDelta("r2", [], error="boom"),
        ],
        timestamp=1.0,
    ),
    StepPlan(
        step_id=3,
        new_requests=[
            NewRequestData("r1", [1, 2, 3], 3, PARAMS, [0, 1], 0),
            NewRequestData("r2", [1, 2, 3], 3, PARAMS, [2], 0, [QWEN_IMAGE], mrope=MROPE),
        ],
        cached_requests=[CachedRequestData("r0", [7], 41)],
        scheduled_req_ids=["r0", "r1"],
        num_scheduled_tokens=[1, 3],
        finished_req_ids=["r9"],
        forced_token_ids={"r0": [5, 6]},
    ),
    StepResult(
        step_id=3,
        req_ids=["r0"],
        sampled_token_ids=[[11]],
        logprobs=[[LOGPROBS]],
        prompt_logprobs={"r1": [LOGPROBS]},
        prompt_logprobs_start={"r1": 0},
        execute_time_s=0.01,
    ),
    SchedulerHello("3f2a9c"),
    Shutdown(),
    SchedulerStats(
        timestamp=2.0,
        engine="0",
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.25,
        step_tokens=[3, 1],
        roofline={"decode": PhaseTotals(1, 0.01, 2e9, 3e8)},
        recent_steps=[StepRecord(3, 0, 0.02), StepRecord(0, 1, 0.01, preemptions=1)],
        kv_block_map=KVBlockMap(8, used=[100, 0], cached=[0, 25]),
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: msgspec.Struct) -> None:
    data = msgspec.msgpack.encode(message)
    assert msgspec.msgpack.decode(data, type=type(message)) == message


def test_worker_channel_is_a_tagged_union() -> None:
    decoder = msgspec.msgpack.Decoder(WorkerInput)
    plan = next(m for m in MESSAGES if isinstance(m, StepPlan))
    for message in (plan, SchedulerHello("3f2a9c", leave=["w0", "w1"]), Shutdown()):
        assert decoder.decode(msgspec.msgpack.encode(message)) == message


def test_defaults_are_omitted_on_the_wire() -> None:
    small = msgspec.msgpack.encode(SamplingParams())
    assert len(small) < 4  # an empty map: every field at its default


def test_wrong_types_are_rejected() -> None:
    bad = msgspec.msgpack.encode({"type": "AddRequest", "req_id": 5})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=AddRequest)


def test_every_channel_union_decodes_with_one_decoder() -> None:
    """All Structs are array-like, so each channel's tagged union needs one decoder."""
    from kvflow.proto.control import LauncherInput, WorkerOutput
    from kvflow.proto.frontend import FrontendInput
    from kvflow.services.detokenizer.main import DetokenizerInput
    from kvflow.services.scheduler.main import SchedulerInput

    for union in (SchedulerInput, DetokenizerInput, WorkerInput, WorkerOutput, LauncherInput):
        msgspec.msgpack.Decoder(union)
    msgspec.msgpack.Decoder(FrontendInput)
    decoder = msgspec.msgpack.Decoder(SchedulerInput)
    abort = AbortRequests(["r1"])
    assert decoder.decode(msgspec.msgpack.encode(abort)) == abort
