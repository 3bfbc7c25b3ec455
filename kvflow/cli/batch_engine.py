"""The frontend's engine interface served by an in-process `LLMEngine`.

`kvflow run-batch` runs each line through the server's own request handling
(services/frontend/serving_*.py), which awaits per-request delta streams from an
engine client. Here those streams are fed by stepping the offline engine on the
event loop: every request is admitted before the first step, so they batch, and
each step's deltas go to the streams that wait on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from kvflow.errors import InvalidRequestError
from kvflow.offline.engine import LLMEngine
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput, MRopePositions
from kvflow.sampling_params import SamplingParams, child_request_ids
from kvflow.services.frontend.request_deadline import Deadline


class OfflineEngineClient:
    """The handlers' engine client (services/frontend/serving_engine.py), one engine."""

    engine_count = 1

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutputDelta]] = {}  # child id -> queue

    def health_problem(self) -> str | None:
        return None  # a failed step raises out of `run_until_done` instead

    def check_rank(self, rank: int | None) -> None:
        if rank is not None and rank != 0:
            raise InvalidRequestError(
                f"data_parallel_rank {rank} is out of range: this run has one engine",
                param="data_parallel_rank",
            )

    def engine_label(self, delta: RequestOutputDelta) -> str | None:
        """One engine: the request-level metrics keep their configured label."""
        return None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        data_parallel_rank: int | None = None,
        deadline: Deadline | None = None,
        *,
        images: list[ImageInput] | None = None,
        lora_request: LoRARequest | None = None,
        mrope: MRopePositions | None = None,  # with images only, which lines do not take
        resume: list[list[int] | None] | None = None,
    ) -> AsyncGenerator[RequestOutputDelta, None]:
        """Deltas of all n samples as the steps make them; ends when every one finished."""
        if images:  # the offline engine takes PIL images (LLM.generate), not wire inputs
            raise InvalidRequestError("run-batch lines take no images", param="messages")
        if resume is not None:  # (its gate has no cluster secret: it refuses kv_resume first)
            raise InvalidRequestError("run-batch lines resume no stream", param="kv_resume")
        child_ids = child_request_ids(request_id, params.n)
        queue: asyncio.Queue[RequestOutputDelta] = asyncio.Queue()
        unfinished = set(child_ids)
        for child_id in child_ids:
            self._queues[child_id] = queue
        try:
            self.engine.add_request(
                request_id, prompt_token_ids, params, priority=priority,
                cache_salt=cache_salt, lora_request=lora_request,
            )  # fmt: skip
            while unfinished:
                delta = await queue.get()
                if delta.finish_reason is not None:
                    unfinished.discard(delta.req_id)
                yield delta
                if unfinished and deadline is not None and deadline.remaining() <= 0:
                    raise deadline.error()
        finally:
            for child_id in child_ids:
                self._queues.pop(child_id, None)
            if unfinished:
                self.engine.abort_request(request_id)

    async def run_until_done(self, tasks: Sequence[asyncio.Task[bytes]]) -> None:
        """Step the engine until every task finished. Steps block the loop; the tasks
        run between them. A step that raises ends the run (the caller cancels)."""
        for _ in range(_ADMIT_TICKS):  # every line admitted before the first step
            await asyncio.sleep(0)
        while not all(task.done() for task in tasks):
            await asyncio.sleep(0)  # the tasks submit, and consume the last deltas
            if not self.engine.has_unfinished_requests():
                continue
            for delta in self.engine.step_deltas():
                queue = self._queues.get(delta.req_id)
                if queue is not None:
                    queue.put_nowait(delta)


# Loop turns a request takes from its task's start to `add_request` (several prompts
# of one completions request run in tasks of their own: one turn more).
_ADMIT_TICKS = 4
