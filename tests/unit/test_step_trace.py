"""The step trace writer (Chrome Trace Event Format), and the scheduler loop feeding it
and its roofline totals from real plans."""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import msgspec

from kvflow.config import SchedulerConfig
from kvflow.metrics.roofline import (
    ModelShape,
    RooflineMeter,
    StepBatch,
    StepCost,
    estimate_step_cost,
)
from kvflow.proto.engine import AddRequest
from kvflow.proto.stats import SchedulerStats
from kvflow.proto.step import StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.admission import EngineLimits
from kvflow.services.scheduler.engine_core import EngineCore
from kvflow.services.scheduler.instruments import Instruments
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.liveness import Liveness
from kvflow.services.scheduler.loop import Outputs, SchedulerLoop
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.services.scheduler.step_trace import StepSample, StepTrace

SHAPE = ModelShape(64, 2, 4, 2, 16, 128, 100, 4)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: msgspec.Struct, *, to: bytes | None = None) -> None:
        self.sent.append(message)


def sample(step_id: int, batch: StepBatch, preemptions: int) -> StepSample:
    return StepSample(
        step_id=step_id,
        start_s=100.0 + step_id,
        duration_s=0.25,
        batch=batch,
        cost=StepCost(2e9, 3e6),
        num_running=2,
        num_waiting=1,
        kv_cache_usage=0.125,
        num_preemptions=preemptions,
    )


def test_writer_events(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace = StepTrace(path, process_name="sched")
    trace.record_step(sample(1, StepBatch([7, 1], [7, 5], 2, 7), preemptions=0))
    trace.flush()
    json.loads(path.read_text() + "]")  # before close: only the bracket is missing
    trace.record_step(sample(2, StepBatch([1, 1], [8, 6], 2, 0), preemptions=3))
    trace.close()
    trace.close()  # idempotent
    events = json.loads(path.read_text())
    assert [(e["ph"], e["name"]) for e in events] == [
        ("M", "process_name"),
        ("M", "thread_name"),
        *[
            (ph, name)
            for step in ("prefill step", "decode step")
            for ph, name in [
                ("X", step),
                ("C", "tokens"),
                ("C", "requests"),
                ("C", "kv_cache_usage_perc"),
                ("C", "preemptions"),
            ]
        ],
    ]
    assert events[0]["args"] == {"name": "sched"}
    first, second = events[2], events[7]
    assert (first["ts"], first["dur"], second["ts"]) == (101e6, 250e3, 102e6)
    assert first["args"] == {
        "step_id": 1,
        "num_reqs": 2,
        "prefill_tokens": 7,
        "decode_tokens": 1,
        "num_logits": 2,
        "preemptions": 0,
        "kv_cache_usage_perc": 12.5,
        "est_flops": 2e9,
        "est_bytes": 3e6,
    }
    assert second["args"]["preemptions"] == 3  # cumulative 0 -> 3
    assert events[3]["args"] == {"prefill": 7, "decode": 1}
    assert events[4]["args"] == {"in_batch": 2, "running": 2, "waiting": 1}
    assert events[11]["args"] == {"total": 3}
    assert {e["pid"] for e in events} == {events[0]["pid"]}


def test_loop_traces_steps_and_counts_roofline(tmp_path: Path) -> None:
    kv_cache = KVCacheManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv_cache, max_model_len=32)
    core = EngineCore(scheduler, EngineLimits(100, 32, 4, 16, frozenset({2})))
    outputs = Outputs(plans=Recorder(), detokenizer=Recorder(), stats=Recorder())
    inbox: queue.Queue[Any] = queue.Queue()
    trace = StepTrace(tmp_path / "t.json")
    instruments = Instruments(
        RooflineMeter(SHAPE), trace, {"model_load": 1.5}, peak_flops=1e12, peak_bandwidth=1e10
    )
    loop = SchedulerLoop(
        core,
        outputs,
        inbox,
        Liveness(5.0, {0: 1e18}),
        "0",
        instruments,
    )
    params = SamplingParams(max_tokens=3, temperature=0.0)
    inbox.put(AddRequest("a", [5, 6, 7, 8, 9], params, arrival_time=0.0, frontend_id="f"))
    loop.run_once()
    for step_id, token in ((1, 11), (2, 12), (3, 13)):
        inbox.put(StepResult(step_id=step_id, req_ids=["a"], sampled_token_ids=[[token]]))
        loop.run_once()
    stats = loop.stats_message()
    trace.close()
    steps = [e for e in json.loads(trace.path.read_text()) if e["ph"] == "X"]
    assert [e["name"] for e in steps] == ["prefill step", "decode step", "decode step"]
    assert [(e["args"]["prefill_tokens"], e["args"]["decode_tokens"]) for e in steps] == [
        (5, 0),
        (0, 1),
        (0, 1),
    ]
    assert all(e["dur"] >= 0 for e in steps)
    prefill = estimate_step_cost(SHAPE, StepBatch([5], [5], 1, 5))
    decodes = [estimate_step_cost(SHAPE, StepBatch([1], [n], 1, 0)) for n in (6, 7)]
    assert (stats.roofline["prefill"].steps, stats.roofline["decode"].steps) == (1, 2)
    assert stats.roofline["prefill"].flops == prefill.flops
    assert stats.roofline["decode"].bytes == sum(c.bytes for c in decodes)
    assert (stats.peak_flops, stats.peak_bandwidth) == (1e12, 1e10)
    assert stats.startup_phases == {"model_load": 1.5}
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats)
    assert wire == stats
