"""LoRA adapters in the scheduler: at most `max_loras` distinct adapters run at once.

The worker has `max_loras` adapter slots, so the running requests may use at most that
many distinct adapters (the base model needs no slot). Every step's adapters are then
a subset of the running ones. A waiting request whose adapter would be one too many
is passed over (`skips_admission`), and requests behind it with a running adapter, or
none, start meanwhile. So that it cannot starve while others keep its rivals' adapters
busy, once it has been passed over `patience` steps it holds the queue
(`stops_admission`): nobody behind it starts until a slot's adapter has drained and it
takes the slot.

The adapter is also part of the prefix-cache key (kvflow/block_hash.py, via
`Request.lora_int_id`): no KV is shared across adapters or with the base.
"""

from __future__ import annotations

from kvflow.proto.stats import LoRAStats
from kvflow.services.scheduler.kv_cache_manager import ComputedBlocks
from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.snapshot import FeatureStats
from kvflow.services.scheduler.step_features import (
    NOTHING_EXTERNAL,
    External,
    StepBuilder,
    StepFeature,
)

LORA_PATIENCE = 8  # steps a request is passed over before it holds the queue


class LoraFeature(StepFeature):
    def __init__(self, max_loras: int, patience: int = LORA_PATIENCE) -> None:
        self.max_loras = max_loras
        self.patience = patience
        self._running: list[Request] = []  # the scheduler's live running list
        self._active: set[int] = set()  # adapters of the running requests (+ admitted)
        self._passed_over: dict[str, int] = {}  # req_id -> steps it was passed over
        self._waiting: dict[str, str] = {}  # req_id -> adapter name, while not running

    def on_add(self, request: Request) -> None:
        if request.lora_request is not None:
            self._waiting[request.request_id] = request.lora_request.lora_name

    def begin_step(self, step: StepBuilder) -> None:
        self._running = step.running
        self._active = {r.lora_int_id for r in step.running if r.lora_int_id}

    def _fits(self, request: Request) -> bool:
        lora_id = request.lora_int_id
        return not lora_id or lora_id in self._active or len(self._active) < self.max_loras

    def stops_admission(self, request: Request) -> bool:
        return (
            not self._fits(request)
            and self._passed_over.get(request.request_id, 0) >= self.patience
        )

    def skips_admission(self, request: Request) -> bool:
        if self._fits(request):
            return False
        self._passed_over[request.request_id] = self._passed_over.get(request.request_id, 0) + 1
        return True

    def admission(self, request: Request, computed: ComputedBlocks) -> External | None:
        if request.lora_int_id:
            self._active.add(request.lora_int_id)
        self._passed_over.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        return NOTHING_EXTERNAL

    def on_preempt(self, request: Request, step: StepBuilder | None) -> None:
        if request.lora_request is not None:
            self._waiting[request.request_id] = request.lora_request.lora_name

    def on_finish(self, request: Request) -> None:
        self._passed_over.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)

    def add_stats(self, stats: FeatureStats) -> None:
        running = {r.lora_request.lora_name for r in self._running if r.lora_request}
        stats.lora = LoRAStats(
            running=sorted(running),
            waiting=sorted(set(self._waiting.values()) - running),
            max_lora=self.max_loras,
        )
