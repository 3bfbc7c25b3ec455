"""What the request handlers use of an engine client.

The server's `EngineClient` reaches its engines over ZeroMQ; `kvflow run-batch` feeds
the same handlers from an in-process engine (kvflow/cli/batch_engine.py). Both are
checked against this protocol, so a handler that starts using more of the client, or a
new argument of `generate`, fails the type check in both places.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput, MRopePositions
from kvflow.sampling_params import SamplingParams
from kvflow.services.frontend.request_deadline import Deadline


class ServingEngine(Protocol):
    @property
    def engine_count(self) -> int:
        """How many engines share the requests (data parallelism)."""
        ...

    def health_problem(self) -> str | None: ...

    def check_rank(self, rank: int | None) -> None: ...

    def engine_label(self, delta: RequestOutputDelta) -> str | None: ...

    def generate(
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
        mrope: MRopePositions | None = None,
        resume: list[list[int] | None] | None = None,
    ) -> AsyncGenerator[RequestOutputDelta, None]: ...
