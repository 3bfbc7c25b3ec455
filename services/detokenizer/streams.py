"""The detokenizer's request table: token deltas in, text deltas per frontend out (sans-IO).

One `IncrementalDetokenizer` per live request. A request is registered by its
`AddRequest` (forwarded by the scheduler on the same socket as the deltas, so it always
comes first) and forgotten with its final delta. Deltas of unknown requests are
dropped: they are tokens the scheduler sampled before it learnt of a stop string.

    EngineOutputs ─▶ per delta: text + token strings ─▶ RequestOutputDelta ─┐
                                  stop string hit? ─▶ AbortRequests("stop") │
    grouped per frontend_id, in arrival order ◀────────────────────────────┘
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvflow.proto.engine import AbortRequests, AddRequest, EngineOutputs, TokenDelta
from kvflow.proto.frontend import RequestOutputDelta
from kvflow.proto.step import TokenLogprobs
from kvflow.services.detokenizer.incremental import DetokenizerUpdate, IncrementalDetokenizer
from kvflow.token_strings import convert_ids_to_token_strings

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    frontend_id: str
    detokenizer: IncrementalDetokenizer | None  # None: it could not be built (bad ids)
    num_output_tokens: int = 0
    resumed_text: str = ""  # the text of AddRequest.output_token_ids, sent with the first delta


@dataclass
class Routed:
    """What one EngineOutputs turned into."""

    by_frontend: dict[str, list[RequestOutputDelta]] = field(default_factory=dict)
    aborts: list[AbortRequests] = field(default_factory=list)  # stop strings, errors


class DetokenizerStreams:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}
        self.frontends: set[str] = set()  # every frontend seen (told when the engine dies)

    def add(self, message: AddRequest) -> None:
        self.frontends.add(message.frontend_id)
        try:
            made = IncrementalDetokenizer(
                self.tokenizer, message.prompt_token_ids, message.sampling_params
            )
            resumed = ""
            if message.output_token_ids:  # resumed: its text so far reached the client
                resumed = made.update(message.output_token_ids).delta
            detokenizer: IncrementalDetokenizer | None = made
        except Exception:  # the scheduler rejects such a request and sends its error
            logger.exception("no detokenizer for request %s", message.req_id)
            detokenizer, resumed = None, ""
        self.streams[message.req_id] = _Stream(message.frontend_id, detokenizer, 0, resumed)

    def process(self, outputs: EngineOutputs) -> Routed:
        routed = Routed()
        by_frontend: dict[str, list[RequestOutputDelta]] = defaultdict(list)
        for delta in outputs.deltas:
            stream = self.streams.get(delta.req_id)
            if stream is None:
                continue
            try:
                out, abort = self._convert(delta, stream)
            except Exception as exc:  # one broken request never stops the others
                logger.exception("detokenizing request %s failed", delta.req_id)
                out = _error_delta(delta, stream, f"detokenizer error: {exc}")
                abort = None if delta.finish_reason else AbortRequests([delta.req_id])
            if abort is not None:
                routed.aborts.append(abort)
            if out.finish_reason is not None:
                del self.streams[delta.req_id]
            by_frontend[stream.frontend_id].append(out)
        routed.by_frontend = dict(by_frontend)
        return routed

    def forget(self, req_ids: list[str]) -> None:
        """Drop requests whose end the caller already knows (an offline abort)."""
        for req_id in req_ids:
            self.streams.pop(req_id, None)

    def drop_frontend(self, frontend_id: str) -> list[str]:
        """Forget the requests of a frontend that went away; returns their ids."""
        req_ids = [r for r, s in self.streams.items() if s.frontend_id == frontend_id]
        for req_id in req_ids:
            del self.streams[req_id]
        self.frontends.discard(frontend_id)
        return req_ids

    def fail_all(self) -> set[str]:
        """The engine died: forget every request; returns the frontends to tell."""
        self.streams.clear()
        return set(self.frontends)

    def _convert(
        self, delta: TokenDelta, stream: _Stream
    ) -> tuple[RequestOutputDelta, AbortRequests | None]:
        finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
        abort = None
        text = ""
        if stream.detokenizer is not None:
            # The scheduler finishes with "stop" only on an EOS or stop token id.
            stop_terminated = finish_reason == "stop"
            update, delta = _update_detokenizer(stream.detokenizer, delta, stop_terminated)
            text = update.delta
            if update.stop_reason is not None:
                # The stop string wins over a length/EOS finish at the same token.
                if finish_reason is None:
                    abort = AbortRequests([delta.req_id], "stop", update.stop_reason)
                finish_reason, stop_reason = "stop", update.stop_reason
            elif finish_reason is not None:
                text += stream.detokenizer.flush().delta
        stream.num_output_tokens += len(delta.new_token_ids)
        out = RequestOutputDelta(
            req_id=delta.req_id,
            text=text,
            token_ids=delta.new_token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            num_output_tokens=stream.num_output_tokens,
            queued_time=delta.queued_time,
            scheduled_time=delta.scheduled_time,
            first_token_time=delta.first_token_time,
            error=delta.error,
            error_code=delta.error_code,
            error_param=delta.error_param,
            pooled=delta.pooled,
            cumulative_logprob=delta.cumulative_logprob,
            resumed_text=stream.resumed_text,
        )
        stream.resumed_text = ""
        if delta.logprobs:
            out.logprobs = delta.logprobs
            out.logprob_tokens = self._token_strings(delta.logprobs)
        if delta.prompt_logprobs:
            out.prompt_logprobs = delta.prompt_logprobs
            out.prompt_logprob_tokens = self._token_strings(delta.prompt_logprobs)
        return out, abort

    def _token_strings(self, entries: list[TokenLogprobs]) -> list[list[str]]:
        """One batched conversion for all positions, split back per position."""
        flat = [token_id for entry in entries for token_id in entry.token_ids]
        strings = convert_ids_to_token_strings(self.tokenizer, flat)
        result, start = [], 0
        for entry in entries:
            result.append(strings[start : start + len(entry.token_ids)])
            start += len(entry.token_ids)
        return result


def _update_detokenizer(
    detokenizer: IncrementalDetokenizer, delta: TokenDelta, stop_terminated: bool
) -> tuple[DetokenizerUpdate, TokenDelta]:
    """Feed a delta's tokens. A delta with several tokens (speculative decoding) and
    stop strings is fed one token at a time, as decoding without speculation would: a
    stop string completed by token i ends the output there, and the tokens after it are
    dropped from the delta (never emitted or counted in usage)."""
    tokens = delta.new_token_ids
    if len(tokens) <= 1 or not detokenizer.has_stop_strings:
        return detokenizer.update(tokens, stop_terminated), delta
    text = ""
    for i, token_id in enumerate(tokens):
        last = i == len(tokens) - 1
        update = detokenizer.update([token_id], stop_terminated and last)
        text += update.delta
        if update.stop_reason is not None:
            kept = msgspec.structs.replace(
                delta, new_token_ids=tokens[: i + 1], logprobs=delta.logprobs[: i + 1]
            )
            return DetokenizerUpdate(text, update.stop_reason, update.final_text), kept
    return DetokenizerUpdate(text), delta


def _error_delta(delta: TokenDelta, stream: _Stream, error: str) -> RequestOutputDelta:
    return RequestOutputDelta(
        req_id=delta.req_id,
        text="",
        token_ids=delta.new_token_ids,
        finish_reason="error",
        num_prompt_tokens=delta.num_prompt_tokens,
        num_output_tokens=stream.num_output_tokens,
        error=error,
    )
