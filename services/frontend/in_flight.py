"""The frontend's requests in flight: which engine holds each child request, what it
has generated so far, and what happens to them when their engine fails.

With several engines (data parallelism) a failed engine's requests move to a serving
one: each is resent with its tokens so far as `AddRequest.output_token_ids`, so the new
engine recomputes their KV, as after a preemption, and samples on. Seeds, penalties,
max_tokens and stop strings carry on as if the request had never moved, and the client
sees no error. Never back to the engine that failed, though: the frontend aborts the
old request there, and that abort's echo would end the new one.

A request with nowhere to go (one engine, or a `data_parallel_rank` that pins it) is
held instead, for up to `resend_wait_s`, until an engine serves again: a restarted
scheduler or detokenizer (compose restarts them; the worker and its weights live on),
or a stalled one that speaks again. It is then resent the same way, so its client sees
a pause, not an error. Past the wait, or after a death the launcher calls final, it
ends with an error delta that names the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
    # The frontend aborted it on a failed engine to send it again: an "abort" end from
    # there is that abort's echo, not the request's end.
    aborted_here: bool = False

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


@dataclass
class HeldRequest:
    """A child request whose engine failed while no other could take it."""

    reason: str  # its error, should no engine serve again by `deadline`
    deadline: float  # time.monotonic()


class InFlightRequests(ABC):
    """The requests in flight over `engines`; EngineClient sends and routes them."""

    engines: list[EngineLink]
    resend_wait_s: float  # how long a failed engine's requests wait for one that serves
    _held: dict[str, HeldRequest]  # child id -> why and until when it waits
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
            self._held.pop(child_id, None)

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
            self.fail_engine(engine.index, reason, abort=abort, reroute=False, hold=False)

    def fail_engine(
        self, engine: int, reason: str, *, abort: bool = False, reroute: bool = True,
        hold: bool = True,
    ) -> None:  # fmt: skip
        """Move the requests in flight on one engine to the others (`reroute`, where
        another serves). The rest wait for an engine that serves again, at most
        `resend_wait_s` (`hold`: the engine may come back), or end with an error delta."""
        child_ids = [c for c in self._queues if self._owners.get(c) == engine]
        if abort:
            self.abort(child_ids)  # before re-routing moves their owner elsewhere
            for child_id in child_ids:
                if (sent := self._sent.get(child_id)) is not None:
                    sent.aborted_here = True
        moved = self._reroute(child_ids, engine) if reroute else set()
        rest = [c for c in child_ids if c not in moved]
        if moved:
            logger.warning("re-routed %d in-flight request(s) after: %s", len(moved), reason)
        if len(self.engines) > 1:
            reason = f"{reason} (engine {engine})"
        if reroute and hold and self.resend_wait_s > 0:
            deadline = time.monotonic() + self.resend_wait_s
            newly = [c for c in rest if c not in self._held]
            for child_id in newly:
                self._held[child_id] = HeldRequest(reason, deadline)
            if newly:
                logger.warning("holding %d in-flight request(s) for up to %.0f s after: %s",
                               len(newly), self.resend_wait_s, reason)  # fmt: skip
            return
        self._fail(rest, reason)

    def _reroute(self, child_ids: list[str], failed: int) -> set[str]:
        """The children moved to another engine than `failed`. A pinned one stays; once
        one finds no engine, none serves for the rest either."""
        moved: set[str] = set()
        for child_id in child_ids:
            sent = self._sent.get(child_id)
            if sent is None or sent.pinned:
                continue
            if self._resend(child_id, avoid=failed) is None:
                break
            moved.add(child_id)
        return moved

    def resend_held(self, now: float) -> None:
        """Resend held requests to an engine that serves again (recomputing their KV, as
        after a preemption); end those held past their deadline with their error."""
        none_serves = False  # an unpinned request found no engine: the rest only expire
        for child_id, held in list(self._held.items()):
            if child_id not in self._queues:  # its caller left meanwhile
                del self._held[child_id]
                continue
            if not none_serves and self._resend(child_id, avoid=None) is not None:
                del self._held[child_id]
                logger.info("resumed held request %s", child_id)
                continue
            sent = self._sent.get(child_id)
            none_serves = none_serves or (sent is not None and not sent.pinned)
            if now >= held.deadline:
                del self._held[child_id]
                self._fail([child_id], held.reason)

    def _resend(self, child_id: str, avoid: int | None) -> int | None:
        """Send a child again, with the tokens it has so far, to the router's choice of
        the serving engines (its own engine only, if a data_parallel_rank pinned it);
        never to `avoid`: that engine's abort of the old request would end the new one.
        Returns the engine, or None where none serves."""
        sent = self._sent.get(child_id)
        if sent is None:
            return None
        rank = self._owners[child_id] if sent.pinned else None
        resumed = sent.resumed()
        try:
            engine = self._route(resumed.prompt_token_ids + resumed.output_token_ids,
                                 resumed.cache_salt, rank, resumed.lora_request,
                                 avoid=avoid)  # fmt: skip
        except EngineDeadError:
            return None
        self._owners[child_id] = engine
        self.engines[engine].input.send(resumed)
        return engine

    def _fail(self, child_ids: list[str], reason: str) -> None:
        for child_id in child_ids:
            self._queues.pop(child_id).put_nowait(error_delta(child_id, reason))
        if child_ids:
            logger.warning("failed %d in-flight request(s): %s", len(child_ids), reason)
