"""Resuming a stream whose decode instance died after the client had some of it (sans-IO).

The text so far can be recomputed from its tokens, so the proxy keeps them: it asks the
decode instance for `return_token_ids`, reads each SSE event it relays, records the
choice's output token ids (and strips them, unless the client asked for them too). When
the stream breaks, the next decode instance gets the client's request plus those tokens
under `kv_resume`, signed like `kv_transfer_params` (an HMAC under the cluster secret over
the ids, a one-time request id and an expiry; services/frontend/kv_params.py). It
recomputes them as after a preemption and streams on from where the old stream stopped;
its chunks are rewritten to carry the first stream's `id` and `created`, so the client
sees one stream.

    decode A: data: {"id": "a", "choices": [{"token_ids": [5, 7], "text": "Hi"}]} ─┐
              ✗ (connection reset)                                           recorded
    decode B ◀─ {... "kv_resume": {"choices": [{"index": 0, "token_ids": [5, 7], ...}],
                                   "signature": ...}} ◀──────────────────────────┘
    decode B: data: {"id": "b", ...} ─▶ client: data: {"id": "a", ...}

A stream fails so by a dropped connection (the instance died), or by the decode
instance's own error event with a 5xx code (its engine died, or it shut down): that
event is not relayed, the stream is resumed instead, as a 5xx answer is resent.

Every choice is resumed from its own tokens (n > 1, several prompts), except one whose
finish_reason went out: the decode instance does not generate it again. Not resumed: a
beam search (its beams are not choices), and any stream of a proxy without a cluster
secret (the signature needs it); such a stream that breaks ends with an error event.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvflow.cluster_secret import KV_PARAMS_TTL_S, ClusterSecret
from kvflow.services.proxy.resend import RETRYABLE_STATUSES

_ID_FIELDS = ("token_ids", "prompt_token_ids")  # what return_token_ids adds to a chunk


def resumable(body: dict[str, Any], secret: ClusterSecret | None) -> bool:
    """Whether a break of this request's stream can be resumed: a stream, not a beam
    search (its beams are not choices), and a secret to sign its tokens with."""
    return secret is not None and bool(body.get("stream")) and not body.get("use_beam_search")


def num_choices(body: dict[str, Any]) -> int:
    """The choices of a stream: n per prompt (a completions prompt may be a list)."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)
    return int(body.get("n") or 1) * (len(prompt) if several else 1)  # type: ignore[arg-type]


def signed_resume(
    secret: ClusterSecret, choices: list[dict[str, Any]], now: float
) -> dict[str, Any]:
    """The `kv_resume` field of a resume request, for `StreamRecord.choices_so_far()`."""
    request_id = uuid.uuid4().hex
    expires_at = round(now + KV_PARAMS_TTL_S, 3)
    signed = [(c["index"], c["finished"], c["token_ids"]) for c in choices]
    return {
        "choices": choices,
        "request_id": request_id,
        "expires_at": expires_at,
        "signature": secret.sign_resume(request_id, expires_at, signed),
    }


@dataclass
class StreamRecord:
    """What a relayed stream has sent its client, per choice: the ids that continue it.
    Whole SSE events only: a partial event waits for its end (bytes the client never saw
    stand for tokens it does not have)."""

    client_wants_ids: bool  # the client asked return_token_ids itself
    num_choices: int
    id: str | None = None  # the first stream's, which resumed chunks carry
    created: int | None = None
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # by choice index
    finished: set[int] = field(default_factory=set)  # finish_reason went out
    # The decode instance's own 5xx error event (its engine died): the stream failed.
    failed: str | None = None
    _pending: bytes = b""

    @property
    def done(self) -> bool:
        """Every choice finished: nothing to resume (only the end went missing)."""
        return len(self.finished) >= self.num_choices

    def relay(self, raw: bytes) -> bytes:
        """The client's bytes for a chunk of the decode stream."""
        if self.failed is not None:
            return b""  # (the stream is being dropped)
        self._pending += raw
        *events, self._pending = self._pending.split(b"\n\n")
        out = []
        for event in events:
            relayed = self._event(event)
            if self.failed is not None:
                break  # the decode instance's failure: resumed, never the client's
            out.append(relayed + b"\n\n")
        return b"".join(out)

    def broke(self) -> list[dict[str, Any]] | None:
        """The stream broke: its unfinished event never reaches the client. Returns the
        choices to resume (each one the client has a chunk of: its index, tokens and
        whether it finished); None while the client has no chunk at all (the request is
        then sent again as it is: its new stream is the client's first)."""
        self._pending, self.failed = b"", None
        if not self.token_ids:
            return None
        return [
            {"index": i, "token_ids": list(ids), "finished": i in self.finished}
            for i, ids in sorted(self.token_ids.items())
        ]

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        chunk = json.loads(event[len(b"data: ") :])
        if not isinstance(chunk, dict) or "choices" not in chunk:
            error = chunk.get("error") if isinstance(chunk, dict) else None
            if isinstance(error, dict) and error.get("code") in RETRYABLE_STATUSES:
                self.failed = str(error.get("message"))  # its engine died, say
            return event  # else the client's own error (a 4xx), as it is
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
        else:  # a resumed stream's chunk: the client's stream is the first one
            chunk["id"], chunk["created"] = self.id, self.created
        for choice in chunk["choices"]:
            index = choice.get("index", 0)
            self.token_ids.setdefault(index, []).extend(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                self.finished.add(index)
        if not self.client_wants_ids:
            _strip_ids(chunk)
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()


def _strip_ids(chunk: dict[str, Any]) -> None:
    for name in _ID_FIELDS:
        chunk.pop(name, None)
    for choice in chunk["choices"]:
        for name in _ID_FIELDS:
            choice.pop(name, None)
