"""The pipeline bubble: the share of time each stage sits idle, from a step trace.

Each pipeline stage's worker reports the spans it was busy with each step (StepResult's
stage_spans, a track per stage in `--trace-file`, services/scheduler/step_trace.py):
preparing the step's inputs, and computing from its input's arrival on. A stage is idle
outside them: waiting for its predecessor's activations, or for the next plan. Over the window from the first span of any stage to the last,

    idle share of stage s = 1 - (time covered by s's spans) / window

    python -m kvflow.bench.pipeline_bubble trace.json
    stage 0: 12.3% idle (824 spans)
    stage 1: 8.1% idle (824 spans)

The spans are wall-clock times of separate processes: exact on one host, as good as
the hosts' clock sync across hosts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

Spans = dict[int, list[tuple[float, float]]]  # stage -> [(start_s, end_s)]


def read_stage_spans(path: str | Path) -> Spans:
    """Each stage's spans from a trace file (also one cut short by a crash: no `]`)."""
    text = Path(path).read_text().rstrip()
    if not text.endswith("]"):
        text += "\n]"
    spans: Spans = {}
    for event in json.loads(text):
        if event.get("ph") == "X" and event.get("cat") == "stage":
            start = event["ts"] / 1e6
            spans.setdefault(int(event["args"]["stage"]), []).append(
                (start, start + event["dur"] / 1e6)
            )
    return spans


def idle_shares(spans: Spans) -> dict[int, float]:
    """stage -> the share of the common window it spent outside its spans (0..1)."""
    if not spans:
        return {}
    start = min(s for stage in spans.values() for s, _ in stage)
    end = max(e for stage in spans.values() for _, e in stage)
    window = end - start
    if window <= 0:
        return dict.fromkeys(spans, 0.0)
    return {stage: 1.0 - _covered(stage_spans) / window for stage, stage_spans in spans.items()}


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `spans` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def report_lines(spans: Spans) -> list[str]:
    shares = idle_shares(spans)
    return [
        f"stage {stage}: {100 * share:.1f}% idle ({len(spans[stage])} spans)"
        for stage, share in sorted(shares.items())
    ]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvflow.bench.pipeline_bubble TRACE_FILE")
        return 2
    spans = read_stage_spans(args[0])
    if not spans:
        print("no pipeline stage spans in this trace (pipeline_parallel_size 1?)")
        return 1
    print("\n".join(report_lines(spans)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
