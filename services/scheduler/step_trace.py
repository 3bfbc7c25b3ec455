"""Scheduler steps as a Chrome / Perfetto trace (`--trace-file PATH`).

The file is the Trace Event Format's JSON *array* form, written as steps finish::

    [
    {"ph": "M", "name": "process_name", ...},          metadata: names the tracks
    {"ph": "X", "name": "prefill step", "ts": ..., "dur": ..., "args": {...}},
    {"ph": "C", "name": "tokens", "ts": ..., "args": {"prefill": 96, "decode": 3}},
    ...
    ]

One step is one complete ("X") event named "prefill step" or "decode step" (which of
the two kinds of tokens is the majority; Perfetto colours by name) spanning plan sent to
result received, with its numbers in `args`, and counter ("C") events at its start for
the tracks tokens, requests, kv_cache_usage_perc and preemptions (and encoder_tokens,
the image features the vision encoder computed, at a step that encoded images). Timestamps are
wall-clock microseconds (they line up with request timestamps and other processes).

With pipeline parallelism each stage gets a track of its own ("pipeline stage S", one
thread id per stage) with two "X" events per step, from the workers' own wall clocks
(StepResult.stage_spans): "prepare" (the plan applied, inputs built) and "compute"
(from its input's arrival to its hand-off or sample). The bubble, where a stage waits
for its predecessor's activations or for the next plan, shows as the gaps.
`python -m kvflow.bench.pipeline_bubble TRACE` prints each stage's idle share.

The closing `]` is written by `close()`, so the file is valid JSON after a clean stop;
after a crash it lacks only that bracket, which the Chrome and Perfetto viewers accept.
The loop calls `record_step` only when tracing is on: off, tracing costs one `if`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvflow.metrics.roofline import StepBatch, StepCost


@dataclass(frozen=True)
class StepSample:
    """What the loop knows of one finished step."""

    step_id: int
    start_s: float  # time.time() when the plan was sent
    duration_s: float
    batch: StepBatch
    cost: StepCost
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, with this step's blocks allocated
    num_preemptions: int  # cumulative
    # Pipeline parallelism: [stage, start_s, end_s] of each stage's compute (wall clock).
    stage_spans: list[list[float]] = field(default_factory=list)
    encoder_tokens: int = 0  # image features the vision encoder computed

    @classmethod
    def of_step(
        cls,
        scheduler: Any,  # services/scheduler/scheduler.py Scheduler: its state after the step
        step_id: int,
        batch: StepBatch,
        cost: StepCost,
        span: tuple[float, float],  # (start_s, duration_s)
        stage_spans: list[list[float]],
        encoder_tokens: int = 0,
    ) -> StepSample:
        return cls(
            step_id=step_id,
            start_s=span[0],
            duration_s=span[1],
            batch=batch,
            cost=cost,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=scheduler.kv_cache.usage,
            num_preemptions=scheduler.num_preemptions,
            stage_spans=stage_spans,
            encoder_tokens=encoder_tokens,
        )


STAGE_TID_BASE = 1  # pipeline stage S is thread id 1 + S (0: the engine's steps)
STAGE_PARTS = ("prepare", "compute")  # a stage's two spans of a step


class StepTrace:
    def __init__(self, path: str | Path, process_name: str = "kvflow scheduler") -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 -- open for the process's life
        self._encoder = msgspec.json.Encoder()
        self._pid = os.getpid()
        self._first = True
        self._last_preemptions = 0
        self._stage_tracks: set[int] = set()
        self._write({"ph": "M", "name": "process_name", "args": {"name": process_name}})
        self._write({"ph": "M", "name": "thread_name", "args": {"name": "engine steps"}})

    def record_step(self, sample: StepSample) -> None:
        batch = sample.batch
        ts = sample.start_s * 1e6
        preempted = sample.num_preemptions - self._last_preemptions
        self._last_preemptions = sample.num_preemptions
        self._write(
            {
                "ph": "X",
                "name": f"{batch.phase} step",
                "cat": "step",
                "ts": ts,
                "dur": sample.duration_s * 1e6,
                "args": {
                    "step_id": sample.step_id,
                    "num_reqs": len(batch.query_lens),
                    "prefill_tokens": batch.num_prompt_tokens,
                    "decode_tokens": batch.num_decode_tokens,
                    "num_logits": batch.num_logits,
                    "preemptions": preempted,
                    "kv_cache_usage_perc": round(100 * sample.kv_cache_usage, 2),
                    "est_flops": sample.cost.flops,
                    "est_bytes": sample.cost.bytes,
                },
            }
        )
        if sample.encoder_tokens:  # a vision model's step that encoded images
            self._counter("encoder_tokens", ts, {"computed": sample.encoder_tokens})
        tokens = {"prefill": batch.num_prompt_tokens, "decode": batch.num_decode_tokens}
        self._counter("tokens", ts, tokens)
        requests = {"in_batch": len(batch.query_lens), "running": sample.num_running}
        self._counter("requests", ts, {**requests, "waiting": sample.num_waiting})
        self._counter("kv_cache_usage_perc", ts, {"usage": round(100 * sample.kv_cache_usage, 2)})
        self._counter("preemptions", ts, {"total": sample.num_preemptions})
        for index, (stage, start_s, end_s) in enumerate(sample.stage_spans):
            part = STAGE_PARTS[index % 2]  # two spans per stage, in order
            self._stage_span(int(stage), part, start_s, end_s, sample.step_id)

    def _stage_span(
        self, stage: int, part: str, start_s: float, end_s: float, step_id: int
    ) -> None:
        tid = STAGE_TID_BASE + stage
        if stage not in self._stage_tracks:
            self._stage_tracks.add(stage)
            name = {"name": f"pipeline stage {stage}"}
            self._write({"ph": "M", "name": "thread_name", "args": name}, tid)
        event = {
            "ph": "X",
            "name": part,
            "cat": "stage",
            "ts": start_s * 1e6,
            "dur": (end_s - start_s) * 1e6,
            "args": {"step_id": step_id, "stage": stage},
        }
        self._write(event, tid)

    def _counter(self, name: str, ts: float, values: dict[str, Any]) -> None:
        self._write({"ph": "C", "name": name, "ts": ts, "args": values})

    def _write(self, event: dict[str, Any], tid: int = 0) -> None:
        event["pid"] = self._pid
        event["tid"] = tid
        self._file.write(b"[\n" if self._first else b",\n")
        self._file.write(self._encoder.encode(event))
        self._first = False

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.write(b"\n]\n")
            self._file.close()
