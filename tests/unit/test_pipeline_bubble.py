"""Pipeline stages in the step trace (a track each) and the bubble computed from it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_step_trace import sample

from kvflow.bench.pipeline_bubble import idle_shares, main, read_stage_spans
from kvflow.metrics.roofline import StepBatch
from kvflow.services.scheduler.step_trace import StepTrace


def test_each_stage_gets_a_named_track_of_its_spans(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace = StepTrace(path)
    batch = StepBatch([1, 1], [8, 6], 2, 0)
    # Two spans per stage: prepare, then compute (stage 1 waited 10.4 .. 10.5 for input).
    spans = [[0, 10.0, 10.0], [0, 10.0, 10.5], [1, 10.3, 10.4], [1, 10.5, 11.0]]
    trace.record_step(dataclasses.replace(sample(1, batch, 0), stage_spans=spans))
    spans = [[0, 10.6, 10.7], [0, 10.7, 11.0], [1, 11.0, 11.0], [1, 11.0, 11.25]]
    trace.record_step(dataclasses.replace(sample(2, batch, 0), stage_spans=spans))
    trace.close()
    events = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "engine steps", 1: "pipeline stage 0", 2: "pipeline stage 1"}
    stage_events = [e for e in events if e.get("cat") == "stage"]
    assert [(e["tid"], e["name"], e["args"]) for e in stage_events] == [
        (tid, part, {"step_id": step, "stage": tid - 1})
        for step in (1, 2)
        for tid in (1, 2)
        for part in ("prepare", "compute")
    ]
    spans_read = read_stage_spans(path)
    flat = [t for span in spans_read[1] for t in span]
    assert flat == pytest.approx([10.3, 10.4, 10.5, 11.0, 11.0, 11.0, 11.0, 11.25])
    # window 10.0 .. 11.25: stage 0 busy 0.5 + 0.4 s, stage 1 busy 0.1 + 0.5 + 0.25 s
    shares = idle_shares(spans_read)
    assert shares == pytest.approx({0: 1 - 0.9 / 1.25, 1: 1 - 0.85 / 1.25})


def test_overlapping_spans_count_once_and_a_cut_trace_is_read(tmp_path: Path) -> None:
    assert idle_shares({0: [(0.0, 2.0), (1.0, 3.0)], 1: [(0.0, 4.0)]}) == {0: 0.25, 1: 0.0}
    assert idle_shares({}) == {}
    path = tmp_path / "cut.json"
    trace = StepTrace(path)
    spans = [[0, 1.0, 2.0], [1, 2.0, 3.0]]
    trace.record_step(
        dataclasses.replace(sample(1, StepBatch([1], [5], 1, 0), 0), stage_spans=spans)
    )
    trace.flush()  # no closing bracket: as after a crash
    assert idle_shares(read_stage_spans(path)) == pytest.approx({0: 0.5, 1: 0.5})
    assert main([str(path)]) == 0


def test_a_trace_without_stages_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plain.json"
    trace = StepTrace(path)
    trace.record_step(sample(1, StepBatch([1], [5], 1, 0), 0))
    trace.close()
    assert main([str(path)]) == 1
    assert "no pipeline stage spans" in capsys.readouterr().out
