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
    decode B ◀─ {... "kv_resume": {"token_ids": [5, 7], "signature": ...}} ◀─────┘
    decode B: data: {"id": "b", ...} ─▶ client: data: {"id": "a", ...}

Resumed: one sample of one prompt (n == 1, no beam search), and only with a cluster
secret (the signature needs it); any other stream that breaks ends with an error event.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvflow.cluster_secret import KV_PARAMS_TTL_S, ClusterSecret

_ID_FIELDS = ("token_ids", "prompt_token_ids")  # what return_token_ids adds to a chunk


def resumable(body: dict[str, Any], secret: ClusterSecret | None) -> bool:
    """Whether a break of this request's stream can be resumed: one streamed sample,
    and a secret to sign its tokens with."""
    prompt = body.get("prompt")
    several_prompts = isinstance(prompt, list) and len(prompt) > 1 and not _ids(prompt)
    return (
        secret is not None
        and bool(body.get("stream"))
        and body.get("n") in (None, 1)
        and body.get("best_of") in (None, 1)
        and not body.get("use_beam_search")
        and not several_prompts
    )


def _ids(prompt: list[Any]) -> bool:
    return all(isinstance(t, int) for t in prompt)


def signed_resume(secret: ClusterSecret, token_ids: list[int], now: float) -> dict[str, Any]:
    """The `kv_resume` field of a resume request."""
    request_id = uuid.uuid4().hex
    expires_at = round(now + KV_PARAMS_TTL_S, 3)
    return {
        "token_ids": token_ids,
        "request_id": request_id,
        "expires_at": expires_at,
        "signature": secret.sign_resume(request_id, expires_at, token_ids),
    }


@dataclass
class StreamRecord:
    """What a relayed stream has sent its client: the ids that continue it, whole SSE
    events only (a partial event waits for its end: bytes the client never saw stand for
    tokens it does not have)."""

    client_wants_ids: bool  # the client asked return_token_ids itself
    id: str | None = None  # the first stream's, which resumed chunks carry
    created: int | None = None
    token_ids: list[int] = field(default_factory=list)
    started: bool = False  # a chunk of the choice went out (chat: its role chunk at least)
    finished: bool = False  # the choice's finish_reason went out: nothing to resume
    _pending: bytes = b""

    def relay(self, raw: bytes) -> bytes:
        """The client's bytes for a chunk of the decode stream."""
        self._pending += raw
        *events, self._pending = self._pending.split(b"\n\n")
        return b"".join(self._event(e) + b"\n\n" for e in events)

    def broke(self) -> list[int] | None:
        """The stream broke: its unfinished event never reaches the client. Returns the
        tokens to resume from; None while the client has no chunk at all (the request
        is then sent again as it is: its new stream is the client's first)."""
        self._pending = b""
        return list(self.token_ids) if self.started else None

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event
        chunk = json.loads(event[len(b"data: ") :])
        if not isinstance(chunk, dict) or "choices" not in chunk:
            return event  # an error event: the client's as it is
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
        else:  # a resumed stream's chunk: the client's stream is the first one
            chunk["id"], chunk["created"] = self.id, self.created
        for choice in chunk["choices"]:
            self.started = True
            self.token_ids += choice.get("token_ids") or []
            self.finished = self.finished or choice.get("finish_reason") is not None
        if not self.client_wants_ids:
            _strip_ids(chunk)
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode()


def _strip_ids(chunk: dict[str, Any]) -> None:
    for name in _ID_FIELDS:
        chunk.pop(name, None)
    for choice in chunk["choices"]:
        for name in _ID_FIELDS:
            choice.pop(name, None)
