"""What the scheduler loop measures besides tokens: estimated work per step phase (the
roofline meter), the web UI's timeline of recent steps, an optional step trace, and
start-up facts it only passes on in its stats."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvflow.metrics.roofline import RooflineMeter
from kvflow.proto.stats import StepRecord
from kvflow.proto.step import StepResult
from kvflow.services.scheduler.engine_core import StepInFlight
from kvflow.services.scheduler.scheduler import Scheduler
from kvflow.services.scheduler.step_trace import StepSample, StepTrace

_MAX_RECENT_STEPS = 64  # steps per stats message for the web UI's timeline (newest kept)


@dataclass
class Instruments:
    roofline: RooflineMeter = field(default_factory=lambda: RooflineMeter(None))
    trace: StepTrace | None = None
    startup_phases: dict[str, float] = field(default_factory=dict)
    peak_flops: float = 0.0  # FLOP/s, 0 = unknown
    peak_bandwidth: float = 0.0  # bytes/s, 0 = unknown
    recent_steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=_MAX_RECENT_STEPS))
    preemptions_seen: int = 0  # the scheduler's count at the last recorded step

    def record_step(
        self, scheduler: Scheduler, step: StepInFlight, seconds: float, result: StepResult
    ) -> None:
        """Roofline totals and the timeline always; the trace only when it is on (KV
        usage after the step's update, before the next plan allocates)."""
        cost = self.roofline.record(step.batch, seconds)
        batch = step.batch
        preemptions = scheduler.num_preemptions
        self.recent_steps.append(
            StepRecord(
                batch.num_prompt_tokens,
                batch.num_decode_tokens,
                seconds,
                preemptions - self.preemptions_seen,
            )
        )
        self.preemptions_seen = preemptions
        if self.trace is not None:
            sample = StepSample.of_step(
                scheduler,
                step.plan.step_id,
                batch,
                cost,
                (time.time() - seconds, seconds),
                result.stage_spans,
                result.encoder_tokens,
            )
            self.trace.record_step(sample)

    def take_recent_steps(self) -> list[StepRecord]:
        steps = list(self.recent_steps)
        self.recent_steps.clear()
        return steps
