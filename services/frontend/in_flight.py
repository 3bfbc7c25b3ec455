"""The frontend's requests in flight: which engine holds each child request, what it
has generated so far, and what happens to them when their engine fails.

With several engines (data parallelism) a failed engine's requests move to a serving
one: each is resent with its tokens so far as `AddRequest.output_token_ids`, so the new
engine recomputes their KV, as after a preemption, and samples on. Seeds, penalties,
max_tokens and stop strings carry on as if the request had never moved, and the client
sees no error. A request pinned by `data_parallel_rank`, or one with nowhere to go,
ends with an error delta that names the engine.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import msgspec

from kvflow.errors import EngineDeadError
from kvflow.proto.engine import AbortRequests, AddRequest
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.lora import LoRARequest
from kvflow.services.frontend.engine_link import EngineLink

logger = logging.getLogger(__name__)


def sample_index(child_id: str) -> int:
    """Index of the sample a child request id stands for (0 when n == 1)."""
    _, sep, index = child_id.rpartition("#")
    return int(index) if sep else 0


def error_delta(child_id: str, reason: str) -> RequestOutputDelta:
    return RequestOutputDelta(child_id, "", [], finish_reason="error", error=reason)


@dataclass
class SentRequest:
    """A child request as first sent, and what it has generated since."""

    request: AddRequest
    pinned: bool  # sent to the engine a data_parallel_rank named: never moved
    output_token_ids: list[int] = field(default_factory=list)
    started: bool = False  # a delta arrived (prompt logprobs come with the first one)

    def observe(self, delta: RequestOutputDelta) -> None:
        self.output_token_ids += delta.token_ids
        self.started = True

    def resumed(self) -> AddRequest:
        """The request to send elsewhere: its tokens so far as output, which the new
        engine recomputes and continues from (seeds, penalties and stop strings as if it
        had never moved); prompt logprobs once delivered are not asked for again."""
        params = self.request.sampling_params
        if self.started and params.prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        return msgspec.structs.replace(
            self.request, sampling_params=params, output_token_ids=list(self.output_token_ids)
        )


class InFlightRequests(ABC):
    """The requests in flight over `engines`; EngineClient sends and routes them."""

    engines: list[EngineLink]
    _queues: dict[str, asyncio.Queue[RequestOutputDelta]]  # child id -> its request's queue
    _owners: dict[str, int]  # child id -> the engine that holds it
    _sent: dict[str, SentRequest]  # child id -> what re-routing it would resend

    @abstractmethod
    def _route(
        self, token_ids: list[int], cache_salt: str | None, rank: int | None,
        lora: LoRARequest | None = None, *, avoid: int | None = None,
    ) -> int:  # fmt: skip
        """The engine a (re)sent request goes to; the router's choice, never `avoid`."""

    def engine_label(self, delta: RequestOutputDelta) -> str | None:
        """The `engine` metrics label of the engine that sent `delta`; None with one
        engine (its label is the frontend's configured one) or for a made-up delta."""
        if len(self.engines) == 1 or delta.engine_index < 0:
            return None
        return str(delta.engine_index)

    def release(self, child_ids: list[str], unfinished: set[str]) -> None:
        """Forget a request's children once its caller is done; the unfinished ones
        (the caller left, or its deadline passed) are aborted on their engine."""
        for child_id in child_ids:
            self._queues.pop(child_id, None)
        if unfinished:
            self.abort(sorted(unfinished))
        for child_id in child_ids:
            self._owners.pop(child_id, None)
            self._sent.pop(child_id, None)

    def abort(self, child_ids: list[str]) -> None:
        """Tell the engines holding these child requests to drop them (frees KV blocks)."""
        by_engine: dict[int, list[str]] = {}
        for child_id in child_ids:
            engine = self._owners.get(child_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(child_id)
        for engine, ids in by_engine.items():
            link = self.engines[engine]
            if link.sockets:
                link.input.send(AbortRequests(req_ids=ids, finish_reason="abort"))

    def fail_all(self, reason: str, *, abort: bool = False) -> None:
        """End every request in flight with an error delta (optionally aborting it)."""
        for engine in self.engines:
            self.fail_engine(engine.index, reason, abort=abort, reroute=False)

    def fail_engine(
        self, engine: int, reason: str, *, abort: bool = False, reroute: bool = True
    ) -> None:
        """Move the requests in flight on one engine to the others (`reroute`, where
        another serves); end the rest with an error delta."""
        child_ids = [c for c in self._queues if self._owners.get(c) == engine]
        if abort:
            self.abort(child_ids)  # before re-routing moves their owner elsewhere
        moved = (
            self._reroute(child_ids, engine, reason) if reroute and len(self.engines) > 1 else set()
        )
        failed = [c for c in child_ids if c not in moved]
        if len(self.engines) > 1:
            reason = f"{reason} (engine {engine})"
        for child_id in failed:
            self._queues.pop(child_id).put_nowait(error_delta(child_id, reason))
        if failed:
            logger.warning("failed %d in-flight request(s): %s", len(failed), reason)

    def _reroute(self, child_ids: list[str], failed: int, reason: str) -> set[str]:
        """Resend these children to another serving engine with the tokens they have so
        far (the new engine recomputes their KV); returns the ones moved. Never back to
        the `failed` engine, even once it serves again: its abort of the old request could
        then end the resent one."""
        moved: set[str] = set()
        for child_id in child_ids:
            sent = self._sent.get(child_id)
            if sent is None or sent.pinned:  # a data_parallel_rank asked for that engine
                continue
            resumed = sent.resumed()
            try:
                engine = self._route(resumed.prompt_token_ids + resumed.output_token_ids,
                                     resumed.cache_salt, None, resumed.lora_request,
                                     avoid=failed)  # fmt: skip
            except EngineDeadError:
                break  # no engine serves: the rest fail
            self._owners[child_id] = engine
            self.engines[engine].input.send(resumed)
            moved.add(child_id)
        if moved:
            logger.warning("re-routed %d in-flight request(s) after: %s", len(moved), reason)
        return moved
